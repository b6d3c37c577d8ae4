"""TRL's reference sync (actor_rollout_ref.ref.sync_ref_model): after every ref_model_sync_steps-th step the
reference is alpha * policy + (1 - alpha) * reference on every parameter, read back from the run's checkpoints
(DCP shards of 2 ranks, converted by torch's own tool) against the formula applied to the pretrained weights; a
resumed run moves it on as the uninterrupted one does."""

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import grpo_config_problems, read_metrics, torchrun
from test_grpo import grpo_args

ALPHA = 0.6
SYNC = dict(actor_rollout_ref__actor__use_kl_loss="true", actor_rollout_ref__actor__kl_loss_coef=0.5,
            actor_rollout_ref__ref__sync_ref_model="true", actor_rollout_ref__ref__ref_model_sync_steps=2,
            actor_rollout_ref__ref__ref_model_mixup_alpha=ALPHA, trainer__save_freq=1, data__val_files="null",
            trainer__checkpoint__save_contents="[model,optimizer,extra]")


def weights(step_dir: str, folder: str, tmp_dir: str) -> dict[str, torch.Tensor]:
    os.makedirs(tmp_dir, exist_ok=True)
    path = os.path.join(tmp_dir, f"{os.path.basename(step_dir)}-{folder.replace('/', '-')}.pt")
    dcp_to_torch_save(os.path.join(step_dir, folder), path)
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def synced(tmp_path_factory, tiny_llama, rl_data):
    out = str(tmp_path_factory.mktemp("sync"))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=4, **SYNC))
    return out


@pytest.mark.slow
def test_the_reference_is_mixed_with_the_policy_every_n_steps(tmp_path, tiny_llama, synced):
    pretrained = load_file(os.path.join(tiny_llama, "model.safetensors"))
    reference = {name: pretrained[name] for name in pretrained}
    for step in range(1, 5):
        step_dir = os.path.join(synced, f"global_step_{step}")
        actor, saved = weights(step_dir, "model", str(tmp_path)), weights(step_dir, "reference/model", str(tmp_path))
        assert set(reference) <= set(saved)
        if step % 2 == 0:
            reference = {name: ALPHA * actor[name] + (1 - ALPHA) * reference[name] for name in reference}
        for name in reference:
            torch.testing.assert_close(saved[name], reference[name], atol=1e-7, rtol=1e-6, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        assert any(not torch.equal(saved[name], pretrained[name]) for name in pretrained) == (step >= 2)


@pytest.mark.slow
def test_a_resumed_run_moves_the_reference_as_the_uninterrupted_one(tmp_path, tiny_llama, rl_data, synced):
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=3, **SYNC))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=4, **SYNC))
    resumed, straight = read_metrics(out), read_metrics(synced)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert resumed[3][key] == pytest.approx(straight[3][key], rel=1e-5, abs=1e-7), key
    mine, theirs = (weights(os.path.join(run, "global_step_4"), "reference/model", str(tmp_path / run.replace(os.sep, "_")))
                    for run in (out, synced))
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.ref.sync_ref_model=true"], "sync_ref_model=true moves the reference, which only the KL uses"),
    (["actor_rollout_ref.ref.sync_ref_model=true", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.lora_rank=4"],
     "LoRA's reference is the actor's own frozen weights"),
    (["actor_rollout_ref.ref.sync_ref_model=true", "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.fsdp_config.fsdp_size=1"],
     "actor_rollout_ref.ref.fsdp_config.fsdp_size (1) must be the actor's (-1)"),
    (["actor_rollout_ref.ref.fsdp_config.fsdp_size=0"], "actor_rollout_ref.ref.fsdp_config.fsdp_size must be -1 (every rank) or a positive"),
    (["actor_rollout_ref.ref.ref_model_mixup_alpha=0"], "ref_model_mixup_alpha must be in (0, 1], got 0"),
    (["actor_rollout_ref.ref.ref_model_sync_steps=0"], "actor_rollout_ref.ref.ref_model_sync_steps must be"),
])
def test_a_sync_that_cannot_work_is_refused(overrides, message):
    assert message in grpo_config_problems(*overrides)
