"""LoRA on both trainers, through the real CLI under torchrun (gloo, CPU): the engine's pieces with adapters
(tests/checks/lora_check.py), a GRPO run against peft and a plain torch loop replaying its rollouts, a resume on
another world size from an adapters-only checkpoint, the errors of settings that cannot work, verl's LoRA recipe,
and vLLM served the merged weights. (LoRA SFT against peft's model on a plain loop is in test_reference.py.)"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.config.verl_keys import translate

from conftest import REPO, assert_same_run, assert_same_weights, grpo_config_problems, hf_weights, read_metrics, run_sft, torchrun
from test_grpo import grpo_args
from test_verl_keys import script_overrides, with_local

SEED, LR, KL_COEF, CLIP = 1, 1e-2, 0.1, 1.0  # trainer.seed initializes the adapters
RECIPE = Path(__file__).parent / "verl_examples" / "run_qwen2_5-3b_gsm8k_grpo_lora.sh"


def test_adapters_train_alone_switch_off_to_the_base_model_and_merge_into_what_peft_computes(ids_llama):
    result = torchrun(2, "tests.checks.lora_check", [ids_llama])
    assert result.stdout.count("ok") == 2


def grpo_reference(model_dir: str, rollouts: list[list[dict]]) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """verl's GRPO step written out on peft's model, one optimizer step per batch of dumped rollouts (one mini-batch,
    one epoch, so the ratio is 1): advantages (score - group mean) / (group std + 1e-6), the token-mean of -A * ratio
    plus KL_COEF x low_var_kl against the model with its adapters off, AdamW after clipping. Returns each step's
    metrics and the final adapters."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(SEED)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.999), weight_decay=0.01)

    def log_probs(row: dict) -> torch.Tensor:
        ids = torch.tensor(row["prompt_ids"] + row["response_ids"])
        logits = model(ids[None]).logits[0, len(row["prompt_ids"]) - 1 : -1]
        return F.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(row["response_ids"])[:, None]).squeeze(1)

    steps = []
    for rows in rollouts:
        scores = torch.tensor([row["score"] for row in rows]).view(-1, 4)
        advantages = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).flatten()
        tokens = sum(len(row["response_ids"]) for row in rows)
        pg_total, kl_total = 0.0, 0.0
        for row, advantage in zip(rows, advantages):
            with torch.no_grad(), model.disable_adapter():
                reference = log_probs(row)
            current = log_probs(row)
            ratio = torch.exp(current - current.detach())
            reverse = reference - current
            kl = (torch.exp(reverse) - reverse - 1).clamp(-10, 10)
            pg = -advantage * ratio
            ((pg.sum() + KL_COEF * kl.sum()) / tokens).backward()
            pg_total += float(pg.detach().sum())
            kl_total += float(kl.detach().sum())
        norm = float(torch.nn.utils.clip_grad_norm_(trained, CLIP))
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"actor/pg_loss": pg_total / tokens, "actor/kl_loss": kl_total / tokens, "actor/grad_norm": norm})
    return steps, get_peft_model_state_dict(model)


@pytest.mark.slow
def test_lora_grpo_on_two_processes_equals_peft_replaying_its_rollouts(tmp_path, tiny_llama, rl_data):
    """Two steps with the KL loss (the reference: the policy with its adapters off), one mini-batch each; the
    engine samples from the merged weights, so its log-probs are the trainer's."""
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(
        tiny_llama, rl_data, out, actor_rollout_ref__model__lora_rank=4, actor_rollout_ref__model__lora_alpha=8,
        actor_rollout_ref__actor__optim__lr=LR, actor_rollout_ref__actor__use_kl_loss="true", actor_rollout_ref__actor__kl_loss_coef=KL_COEF,
        actor_rollout_ref__rollout__calculate_log_probs="true", trainer__rollout_data_dir=f"{out}/rollouts", trainer__save_freq=1,
        trainer__test_freq=-1, trainer__checkpoint__save_contents="[model,optimizer,extra,lora_adapter]"))
    rollouts = [[json.loads(line) for line in open(f"{out}/rollouts/{step}.jsonl")] for step in (1, 2)]
    expected, adapters = grpo_reference(tiny_llama, rollouts)
    metrics = read_metrics(out)
    for step, (logged, reference) in enumerate(zip(metrics, expected), 1):
        for key, value in reference.items():
            assert logged[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step} {key}"
        assert logged["training/rollout_probs_diff_max"] < 1e-4, f"step {step}: the engine does not sample from the trained weights"
    assert expected[1]["actor/kl_loss"] > 1e-6  # the adapters moved the policy off the reference
    trained = load_file(f"{out}/global_step_2/lora_adapter/adapter_model.safetensors")
    assert_same_weights(trained, adapters, atol=0.05 * LR)  # Adam's float noise (see test_reference.py)
    assert sum(os.path.getsize(f"{out}/global_step_2/model/{f}") for f in os.listdir(f"{out}/global_step_2/model")) < 1e6


LORA_SFT = dict(model__lora_rank=4, model__lora_alpha=8, model__target_modules="[q_proj,k_proj,v_proj,o_proj]", optim__lr=1e-2,
                trainer__total_training_steps=4, trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]")


@pytest.fixture(scope="module")
def lora_straight(tmp_path_factory, tiny_llama, chat_data) -> str:
    """Four LoRA SFT steps on 2 processes (dp=2), saved at steps 2 and 4."""
    out = str(tmp_path_factory.mktemp("lora_straight"))
    run_sft(2, tiny_llama, chat_data, out, trainer__save_freq=2, **LORA_SFT)
    return out


@pytest.mark.slow
def test_a_lora_run_resumes_on_another_world_size_from_its_adapters(tmp_path, tiny_llama, chat_data, lora_straight):
    """Saved with 2 processes, resumed with 1: the same losses and merged weights as the run left alone; its
    checkpoint holds the adapters and their optimizer state, a few percent of the model, and the offline export
    merges them into the pretrained folder as the run's own export does."""
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(f"{lora_straight}/global_step_2", f"{resumed}/global_step_2")
    Path(resumed, "latest_checkpointed_iteration.txt").write_text("2")
    run_sft(1, tiny_llama, chat_data, resumed, **LORA_SFT)
    losses = [m["train/loss"] for m in read_metrics(lora_straight)]
    assert [m["train/loss"] for m in read_metrics(resumed)] == pytest.approx(losses[2:], rel=1e-5)
    assert_same_weights(hf_weights(f"{resumed}/global_step_4"), hf_weights(f"{lora_straight}/global_step_4"), atol=1e-5)

    def size(folder: str) -> int:
        return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))

    model_bytes = size(f"{lora_straight}/global_step_4/huggingface")
    assert size(f"{lora_straight}/global_step_4/model") + size(f"{lora_straight}/global_step_4/optimizer") < 0.1 * model_bytes
    subprocess.run([sys.executable, "-m", "fsdptrain.checkpoint.export", f"{lora_straight}/global_step_4", "--out", str(tmp_path / "export")],
                   cwd=REPO, check=True, capture_output=True)
    assert_same_weights(load_file(tmp_path / "export" / "model.safetensors"), hf_weights(f"{lora_straight}/global_step_4"), atol=1e-6)
    refused = run_sft(1, tiny_llama, chat_data, resumed, check=False, **{**LORA_SFT, "model__lora_rank": 8, "trainer__total_training_steps": 6})
    assert refused.returncode != 0 and "was trained with LoRA" in refused.stderr


@pytest.mark.slow
def test_adapters_train_the_same_under_ulysses_gradient_checkpointing_and_offload(tmp_path, tiny_llama, chat_data, lora_straight):
    """One Ulysses group of two (each rank a slice of every packed row), activations recomputed, parameters and
    optimizer state in host memory, micro-batches of one sample: the run of two data-parallel ranks."""
    out = str(tmp_path)
    run_sft(2, tiny_llama, chat_data, out, ulysses_sequence_parallel_size=2, model__enable_gradient_checkpointing="true",
            model__fsdp_config__cpu_offload="true", data__use_dynamic_bsz="false", data__micro_batch_size_per_gpu=1, model__chunked_loss_tokens=16,
            **LORA_SFT)
    assert_same_run(out, lora_straight)


@pytest.mark.parametrize("targets, message", [
    ("[qkv_proj]", "The model's linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ("[q_proj,lm_head]", "adapters go on the decoder layers' linear layers, not on ['lm_head']"),
])
def test_targets_that_cannot_work_are_named_before_training(tmp_path, tiny_llama, chat_data, targets, message):
    result = run_sft(1, tiny_llama, chat_data, str(tmp_path), check=False, model__lora_rank=4, model__target_modules=targets)
    assert result.returncode != 0 and "model.target_modules" in result.stderr and message in result.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_lora_settings_are_checked_with_the_other_keys():
    found = grpo_config_problems("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.target_modules=[]",
                     "actor_rollout_ref.model.lora_dropout=1.5")
    for expected in ("lora_alpha must be > 0", "target_modules must be all-linear, a module name or a list of them",
                     "lora_dropout must be in [0, 1)"):
        assert expected in found, expected
    assert "lora_rank must be >= 0" in grpo_config_problems("actor_rollout_ref.model.lora_rank=-1")
    assert "lora_adapter, which needs actor_rollout_ref.model.lora_rank > 0" in grpo_config_problems("trainer.checkpoint.save_contents=[model,lora_adapter]")


def test_verls_lora_recipe_loads_as_written(tmp_path, capsys):
    local = {"data.train_files": tmp_path / "train.parquet", "data.val_files": tmp_path / "test.parquet",
             "actor_rollout_ref.model.path": "/models/x", "trainer.n_gpus_per_node": 2}
    overrides, problems = translate(with_local(script_overrides(RECIPE), local), "grpo", 2)
    assert problems == []
    assert "actor_rollout_ref.rollout.layered_summon=True changes nothing here" in capsys.readouterr().err
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=overrides))
    lora = config.actor_rollout_ref.model.lora("actor_rollout_ref.model")
    assert (lora.rank, lora.alpha, lora.target_modules) == (64, 32, "all-linear")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_samples_from_the_merged_weights(tmp_path, vllm_llama, rl_data):
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(vllm_llama, rl_data, out, actor_rollout_ref__model__lora_rank=8,
                                                    actor_rollout_ref__rollout__name="vllm", actor_rollout_ref__rollout__gpu_memory_utilization=0.1,
                                                    actor_rollout_ref__actor__optim__lr="1e-2", trainer__test_freq=-1))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["actor/grad_norm"] > 0
    assert metrics[1]["training/rollout_probs_diff_max"] < 1e-4  # after the first update's merged weights
