"""The reward model (rl/reward_model.py) in GRPO runs on 2 processes: each response's dumped score equals a plain
transformers sequence-classification forward of the same tokens (packed and padded micro-batches), re-templated with
the reward model's own chat template where its tokenizer differs, and weighted beside the verifiers."""

import copy
import json
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from conftest import REPO, free_port, read_metrics, torchrun, wait_until_serving
from test_grpo import grpo_args

pytestmark = pytest.mark.slow


def save_reward_model(path, tokenizer, chat_template: str | None = None) -> str:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id or 2, bos_token_id=1, eos_token_id=2)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ from response to response
    model.save_pretrained(path)
    if chat_template is not None:
        tokenizer = copy.deepcopy(tokenizer)  # the session's tokenizer keeps its own template for the other tests
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return str(path)


def independent_scores(model_dir: str, sequences: list[list[int]]) -> list[float]:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in sequences]


def rollouts(out: str, step: int) -> list[dict]:
    return [json.loads(line) for line in open(f"{out}/rollouts/{step}.jsonl")]


@pytest.mark.parametrize("packed, fsdp_size", [("true", -1), ("false", -1), ("true", 1)], ids=["packed", "padded", "packed-hybrid"])
def test_the_reward_models_scores_are_a_plain_forward_of_the_same_tokens(tmp_path, tokenizer, tiny_llama, rl_data, packed, fsdp_size):
    """Scores of the reward model sharded over both ranks, or hybrid-sharded by its own fsdp_size (2 replicas of one
    shard), against a plain transformers forward."""
    reward_model = save_reward_model(tmp_path / "rm", tokenizer)
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, custom_reward_function__path="null", reward_model__enable="true",
                                                    reward_model__model__path=reward_model, reward_model__model__use_remove_padding=packed,
                                                    reward_model__model__fsdp_config__fsdp_size=fsdp_size,
                                                    reward_model__micro_batch_size_per_gpu=3, trainer__rollout_data_dir=f"{out}/rollouts"))
    for step in (1, 2):
        rows = rollouts(out, step)
        expected = independent_scores(reward_model, [r["prompt_ids"] + r["response_ids"] for r in rows])
        assert [r["source/reward_model"] for r in rows] == pytest.approx(expected, abs=1e-5)
        assert [r["score"] for r in rows] == pytest.approx(expected, abs=1e-5)  # the reward model alone, as verl scores with one
        assert len(set(expected)) > 1
    assert read_metrics(out)[1]["critic/rewards/reward_model/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_another_tokenizer_is_fed_its_own_template_and_weighted_beside_the_verifiers(tmp_path, tokenizer, tiny_llama, rl_data):
    template = "{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
    reward_model = save_reward_model(tmp_path / "rm", tokenizer, chat_template=template)
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, custom_reward_function__path="null", reward_model__enable="true",
                                                    reward_model__model__path=reward_model, reward_model__weight=0.5,
                                                    reward__sources="[{name: acc, function: gsm8k}, {name: format, function: strict_format}]",
                                                    trainer__rollout_data_dir=f"{out}/rollouts"))
    rows = rollouts(out, 1)
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_model)
    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    sequences = [rm_tokenizer.apply_chat_template([*r["prompt"], {"role": "assistant", "content": policy_tokenizer.decode(r["response_ids"],
                                                                                                                       skip_special_tokens=True)}],
                                                  tokenize=True, return_dict=True)["input_ids"] for r in rows]
    assert rm_tokenizer.decode(sequences[0]).startswith("<user>: ")
    expected = independent_scores(reward_model, sequences)
    assert [r["source/reward_model"] for r in rows] == pytest.approx(expected, abs=1e-5)
    assert [r["score"] for r in rows] == pytest.approx([r["source/acc"] + r["source/format"] + 0.5 * e for r, e in zip(rows, expected)], abs=1e-5)
    metrics = read_metrics(out)[0]
    assert metrics["critic/rewards/reward_model/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_the_reward_server_serves_a_reward_model(tmp_path, tokenizer):
    """`fsdptrain.reward_server --model`: texts of different lengths in one request score as each alone."""
    reward_model = save_reward_model(tmp_path / "rm", tokenizer)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "fsdptrain.reward_server", "--model", reward_model, "--port", str(port)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        wait_until_serving(url, server)
        texts = ["What is 2 plus 3? It is 5. #### 5", "Hi", "A longer answer, with several words in it, ends here"]
        rewards = httpx.post(url, json={"query": texts}, timeout=30.0).json()["rewards"]
    finally:
        server.kill()
        server.wait(timeout=10)
    rm_tokenizer = AutoTokenizer.from_pretrained(reward_model)
    expected = independent_scores(reward_model, [rm_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    assert rewards == pytest.approx(expected, abs=1e-5)
