"""Added tokens (model.added_tokens_file: MiniOneRec's semantic IDs) and freeze_llm, through the CLI: the tokenizer of
every checkpoint and export holds the tokens, transformers and vLLM load the export; with freeze_llm every
pretrained parameter (the old rows of the embedding among them) ends bit for bit as it began while the added
tokens' rows train, with weight decay on, the same on 1 and 2 processes; GRPO trains from the SFT export with the
same freeze."""

import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdptrain.errors import ConfigError
from fsdptrain.models.added_tokens import add_model_tokens, grow_embeddings, read_added_tokens

from conftest import REPO, assert_same_run, grpo_config_problems, run_sft, save_tiny_model, torchrun
from test_grpo import grpo_args

CODES = 6  # per level: 18 tokens
SAVE_HF = "[model,optimizer,extra,hf_model]"


def sid(item: int) -> str:
    return f"<a_{item % CODES}><b_{item // CODES % CODES}><c_{(item * 5) % CODES}>"


@pytest.fixture(scope="module")
def catalog(tmp_path_factory) -> dict[str, str]:
    """A MiniOneRec index (item -> its three code tokens) and chats that answer a history with the next item."""
    path = tmp_path_factory.mktemp("catalog")
    index = {str(item): [f"<a_{item % CODES}>", f"<b_{item // CODES % CODES}>", f"<c_{(item * 5) % CODES}>"] for item in range(30)}
    (path / "items.index.json").write_text(json.dumps(index))
    rng = random.Random(0)
    for split, rows in (("train", 32), ("val", 8)):
        chats = []
        for _ in range(rows):
            start = rng.randrange(26)
            history = ", ".join(sid(item) for item in range(start, start + 3))
            chats.append([{"role": "user", "content": f"The user bought {history}. Next?"}, {"role": "assistant", "content": sid(start + 3)}])
        pq.write_table(pa.table({"messages": chats}), str(path / f"{split}.parquet"))
    return {"train": str(path / "train.parquet"), "val": str(path / "val.parquet"), "index": str(path / "items.index.json")}


def tokens_of(catalog: dict[str, str]) -> list[str]:
    return sorted({token for tokens in json.loads(open(catalog["index"]).read()).values() for token in tokens})


def sft_with_tokens(nproc: int, model: str, catalog: dict[str, str], out: str, **overrides):
    return run_sft(nproc, model, catalog, out, model__added_tokens_file=catalog["index"], model__freeze_llm="true",
                   optim__weight_decay=0.1, trainer__save_freq=1, trainer__checkpoint__save_contents=SAVE_HF, **overrides)


@pytest.fixture(scope="module")
def frozen_dp1(tmp_path_factory, tiny_llama, catalog) -> str:
    out = str(tmp_path_factory.mktemp("frozen_dp1"))
    sft_with_tokens(1, tiny_llama, catalog, out)
    return out


def test_the_tokens_of_an_index_or_a_list(tmp_path):
    (tmp_path / "a.index.json").write_text(json.dumps({"0": ["<b_1>", "<a_2>"], "1": ["<a_2>", "<c_0>"]}))
    (tmp_path / "b.txt").write_text("<x>\n\n<a>\n<x>\n")
    assert read_added_tokens(str(tmp_path / "a.index.json"), "k") == ["<a_2>", "<b_1>", "<c_0>"]
    assert read_added_tokens(str(tmp_path / "b.txt"), "k") == ["<a>", "<x>"]
    (tmp_path / "bad.json").write_text(json.dumps({"0": "<a_1>"}))
    (tmp_path / "empty.txt").write_text("\n")
    for name, message in (("bad.json", "must map each item to its list of tokens"), ("empty.txt", "holds no tokens"),
                          ("none.txt", "does not exist")):
        with pytest.raises(ConfigError, match=message):
            read_added_tokens(str(tmp_path / name), "model.added_tokens_file")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_added_rows_from_their_pieces(tmp_path, tokenizer, catalog, tied):
    """added_tokens_init=pieces: each new token's row (input embedding and untied output layer) is the mean of the
    rows of the old tokens its text was split into; the old rows are untouched."""
    folder = save_tiny_model(tmp_path / "model", "qwen2", tokenizer, tie_word_embeddings=tied)
    grown = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    before = [m.weight.detach().clone() for m in (model.get_input_embeddings(), model.get_output_embeddings())]
    added = add_model_tokens(SimpleNamespace(added_tokens_file=catalog["index"], added_tokens_init="pieces"), "model", grown, model.config)
    grow_embeddings(model, model.config.vocab_size, added, seed=0)
    old = AutoTokenizer.from_pretrained(folder)
    assert added.new_ids == grown.convert_tokens_to_ids(tokens_of(catalog))
    for matrix, original in zip((model.get_input_embeddings().weight, model.get_output_embeddings().weight), before):
        assert torch.equal(matrix[: len(original)], original)
        for token in tokens_of(catalog):
            pieces = old(token, add_special_tokens=False)["input_ids"]
            assert len(pieces) > 1
            torch.testing.assert_close(matrix[grown.convert_tokens_to_ids(token)], original[pieces].mean(0), rtol=0, atol=1e-7)
    rows = model.get_input_embeddings().weight[added.new_ids]
    assert torch.cdist(rows, rows).add(torch.eye(len(rows))).min() > 1e-3  # distinct from the start (mean_resizing's are ~1e-9 apart)


def test_freeze_llm_needs_added_tokens_and_no_adapters():
    assert "freeze_llm=true trains the added tokens' rows alone" in grpo_config_problems("actor_rollout_ref.model.freeze_llm=true")
    assert "train the added tokens' rows or adapters, not both" in grpo_config_problems(
        "actor_rollout_ref.model.freeze_llm=true", "actor_rollout_ref.model.added_tokens_file=x.json", "actor_rollout_ref.model.lora_rank=4")


@pytest.mark.slow
def test_only_the_added_rows_train_and_the_export_holds_the_tokens(tiny_llama, catalog, frozen_dp1):
    pretrained = load_file(os.path.join(tiny_llama, "model.safetensors"))
    export = os.path.join(frozen_dp1, "global_step_3", "huggingface")
    tokenizer = AutoTokenizer.from_pretrained(export)
    base_tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokens = tokens_of(catalog)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert ids == list(range(len(base_tokenizer), len(base_tokenizer) + len(tokens)))  # added in sorted order, after the old ones
    assert tokenizer(sid(7), add_special_tokens=False)["input_ids"] == tokenizer.convert_tokens_to_ids(
        [f"<a_{7 % CODES}>", f"<b_{7 // CODES % CODES}>", f"<c_{35 % CODES}>"])
    first = load_file(os.path.join(frozen_dp1, "global_step_1", "huggingface", "model.safetensors"))
    last = load_file(os.path.join(export, "model.safetensors"))
    embedding = "model.embed_tokens.weight"
    assert last[embedding].shape[0] == len(tokenizer)
    for name, tensor in pretrained.items():  # the token matrices' old rows, and every other parameter whole
        assert torch.equal(last[name][: tensor.shape[0]], tensor), name
    moved = (last[embedding][ids] - first[embedding][ids]).abs().amax(dim=1)
    assert bool((moved > 0).all()), moved  # every added row trained (each token is in some answer)
    model = AutoModelForCausalLM.from_pretrained(export)  # transformers loads the grown export
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)


@pytest.mark.slow
def test_freeze_llm_trains_the_same_on_one_and_two_processes(tmp_path, tiny_llama, catalog, frozen_dp1):
    sft_with_tokens(2, tiny_llama, catalog, str(tmp_path))
    assert_same_run(str(tmp_path), frozen_dp1)


@pytest.mark.slow
def test_an_untied_output_layer_trains_its_added_rows_alone(tmp_path, tokenizer, catalog):
    model = save_tiny_model(tmp_path / "untied", "qwen2", tokenizer, tie_word_embeddings=False)
    out = str(tmp_path / "run")
    sft_with_tokens(2, model, catalog, out)
    pretrained = load_file(os.path.join(model, "model.safetensors"))
    last = load_file(os.path.join(out, "global_step_3", "huggingface", "model.safetensors"))
    ids = AutoTokenizer.from_pretrained(os.path.join(out, "global_step_3", "huggingface")).convert_tokens_to_ids(tokens_of(catalog))
    for name, tensor in pretrained.items():
        assert torch.equal(last[name][: tensor.shape[0]], tensor), name
    first = load_file(os.path.join(out, "global_step_1", "huggingface", "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert bool(((last[name][ids] - first[name][ids]).abs().amax(dim=1) > 0).all()), name


@pytest.mark.slow
def test_grpo_from_the_sft_export_keeps_the_freeze(tmp_path, tiny_llama, catalog, frozen_dp1, rl_data):
    """GRPO from the SFT export, whose tokenizer already holds the tokens (nothing is added), with freeze_llm and
    the KL loss (the reference is built with the same rows): every parameter but the added rows stays the base's."""
    export = os.path.join(frozen_dp1, "global_step_3", "huggingface")
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(export, rl_data, out, actor_rollout_ref__model__added_tokens_file=catalog["index"],
                                                    actor_rollout_ref__model__freeze_llm="true", actor_rollout_ref__actor__use_kl_loss="true",
                                                    actor_rollout_ref__actor__optim__weight_decay=0.1, data__val_files="null",
                                                    trainer__save_freq=2, trainer__checkpoint__save_contents="[hf_model]"))
    start, end = (load_file(os.path.join(path, "model.safetensors")) for path in (export, os.path.join(out, "global_step_2", "huggingface")))
    ids = AutoTokenizer.from_pretrained(export).convert_tokens_to_ids(tokens_of(catalog))
    frozen = torch.ones(start["model.embed_tokens.weight"].shape[0], dtype=torch.bool)
    frozen[ids] = False
    matrices = {"model.embed_tokens.weight", "lm_head.weight"}
    for name, tensor in start.items():
        assert torch.equal(end[name][frozen], tensor[frozen]) if name in matrices else torch.equal(end[name], tensor), name
    assert not torch.equal(end["model.embed_tokens.weight"][ids], start["model.embed_tokens.weight"][ids])


@pytest.mark.slow
def test_grpo_refuses_to_grow_a_model_its_engine_loads_as_it_is(tmp_path, tiny_llama, catalog, rl_data):
    result = subprocess.run([sys.executable, "-m", "fsdptrain.check", "grpo", *grpo_args(tiny_llama, rl_data, str(tmp_path),
                             actor_rollout_ref__model__added_tokens_file=catalog["index"])], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "add them by SFT (model.added_tokens_file) and train GRPO from its export" in result.stderr + result.stdout


@pytest.mark.slow
def test_vllm_serves_the_grown_export_as_transformers_does(tmp_path, tokenizer, vllm_llama, catalog):
    pytest.importorskip("vllm")
    out = str(tmp_path / "run")
    run_sft(2, vllm_llama, catalog, out, model__added_tokens_file=catalog["index"], optim__lr="1e-2", trainer__checkpoint__save_contents="[hf_model]")
    export = os.path.join(out, "global_step_3", "huggingface")
    script = f"""
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
tokenizer = AutoTokenizer.from_pretrained({export!r})
text = tokenizer.apply_chat_template([{{"role": "user", "content": "The user bought {sid(3)}, {sid(4)}. Next?"}}], add_generation_prompt=True,
                                     tokenize=False)
prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
hf = AutoModelForCausalLM.from_pretrained({export!r}).generate(__import__("torch").tensor([prompt]), max_new_tokens=6, do_sample=False)
llm = LLM({export!r}, dtype="float32", gpu_memory_utilization=0.1, max_model_len=256, enforce_eager=True)
out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=6, temperature=0))
strip = lambda ids: [i for i in ids if i != tokenizer.eos_token_id]
print(json.dumps({{"hf": strip(hf[0, len(prompt):].tolist()), "vllm": strip(list(out[0].outputs[0].token_ids))}}))
"""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in this process, as fsdptrain runs it: no second start-up
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(next(line for line in result.stdout.splitlines() if line.startswith('{"hf"')))
    assert answer["vllm"] == answer["hf"]
    assert any(token >= len(tokenizer) for token in answer["hf"]), answer  # it answers in the added tokens


@pytest.mark.slow
def test_a_vision_language_model_grows_its_decoders_token_matrices(tmp_path, catalog):
    """Added tokens and freeze_llm on a tiny Qwen2.5-VL (its vocabulary is its decoder's, in text_config): the
    export's embedding has a row for every token, the added rows train and every pretrained weight (the vision
    tower's among them) ends as it began; transformers loads the export."""
    from transformers import AutoModelForImageTextToText

    import make_tiny

    folder = tmp_path / "model"
    make_tiny.tiny_vision_language("qwen2_5_vl", make_tiny.trained_tokenizer(), seed=0, out=str(folder))
    out = str(tmp_path / "run")
    sft_with_tokens(1, str(folder), catalog, out, trainer__total_training_steps=2)
    export = os.path.join(out, "global_step_2", "huggingface")
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer.convert_tokens_to_ids(tokens_of(catalog))
    pretrained, trained = (AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict() for path in (folder, export))
    embedding = "model.language_model.embed_tokens.weight"
    assert trained[embedding].shape[0] == len(tokenizer) > pretrained[embedding].shape[0]
    first = AutoModelForImageTextToText.from_pretrained(os.path.join(out, "global_step_1", "huggingface"), dtype=torch.float32).state_dict()
    assert bool(((trained[embedding][ids] - first[embedding][ids]).abs().amax(dim=1) > 0).any())
    for name, tensor in pretrained.items():
        assert torch.equal(trained[name][: tensor.shape[0]], tensor), name
