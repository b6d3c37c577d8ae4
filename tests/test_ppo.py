"""PPO with a critic (algorithm.adv_estimator=gae) through the real CLI under torchrun (gloo, CPU): the critic's
values and gradients against a plain transformers model and the same whatever the layout, a run with every
critic metric and warm-up, its checkpoint with the critic, exact resume, learning, and verl's PPO example scripts
as written. (GAE and the value loss against verl's formulas: test_core_algos.py.)"""

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.config.verl_keys import translate
from fsdptrain.distributed.mesh import World
from fsdptrain.errors import ConfigError
from fsdptrain.rl.core_algos import LOSS_AGG_MODES
from fsdptrain.trainer.grpo_plan import derive, read_grpo_config

from checks.common import relative_gap
from conftest import read_metrics, save_tiny_model, torchrun
from test_grpo import grpo_args
from test_verl_keys import script_overrides, sizes_and_paths, with_local

EXAMPLES = Path(__file__).parent / "verl_examples"


@pytest.mark.slow
def test_critic_gradients_are_the_same_whatever_the_layout(tmp_path, tiny_llama):
    """Each layout's check (tests/checks/critic_check.py) has matched its values and its token-mean gradient to a
    plain transformers model; here every aggregation mode's gradient is compared across layouts: one process
    with micro-batches of 8 packed sequences (prompts shared), two with 1 padded sequence, two at the defaults
    (a token budget), and one Ulysses group of two."""
    layouts = {"dp1-micro8-packed": (1, 8, "true", 1), "dp2-micro1-padded": (2, 1, "false", 1), "dp2-defaults": (2, "default", "true", 1),
               "sp2-micro3-packed": (2, 3, "true", 2)}
    gradients = {}
    for name, (nproc, micro, packed, sp) in layouts.items():
        out = str(tmp_path / f"{name}.pt")
        torchrun(nproc, "tests.checks.critic_check", [tiny_llama, out, str(micro), packed, str(sp)])
        gradients[name] = torch.load(out)
    reference = gradients.pop("dp1-micro8-packed")
    assert set(reference) == set(LOSS_AGG_MODES)
    for layout, runs in gradients.items():
        for mode, grads in runs.items():
            gap = relative_gap(grads, reference[mode])
            assert gap < 5e-6, f"{layout} {mode}: {gap:.2e} of the gradient's norm"


PPO = dict(algorithm__adv_estimator="gae", algorithm__lam=0.95, actor_rollout_ref__rollout__n=1, data__train_batch_size=8,
           actor_rollout_ref__actor__ppo_mini_batch_size=4, critic__ppo_micro_batch_size_per_gpu=2, critic__optim__lr="1e-3",
           critic__model__enable_gradient_checkpointing="false", trainer__critic_warmup=1, critic__model__fsdp_config__cpu_offload="true")
EVERY_OFFLOAD = dict(actor_rollout_ref__actor__fsdp_config__param_offload="true", actor_rollout_ref__actor__fsdp_config__optimizer_offload="true",
                     actor_rollout_ref__ref__fsdp_config__param_offload="true", critic__model__fsdp_config__param_offload="true",
                     critic__model__fsdp_config__optimizer_offload="true")
CRITIC_METRICS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr", "critic/values/mean",
                  "critic/values/max", "critic/values/min", "critic/returns/mean", "critic/returns/max", "critic/returns/min",
                  "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic"]


@pytest.fixture(scope="module")
def ppo_straight(tmp_path_factory, tiny_llama, rl_data):
    out = str(tmp_path_factory.mktemp("ppo"))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=3, trainer__save_freq=3,
                                                    data__val_files="null", **PPO))
    return out


@pytest.mark.slow
def test_ppo_with_kl_hybrid_sharded_trains_as_sharded_over_every_rank(tmp_path, tiny_llama, rl_data):
    """The actor, its reference and the critic each hybrid-sharded by its own fsdp_size (verl's: 4 processes as 2
    replicas of 2 shards; then the reference alone) against sharded over all 4: the same rollouts, losses, values
    and gradient norms, step by step, to 1e-6."""
    runs = {}
    for name, (actor, ref, critic) in {"full": (-1, -1, -1), "hybrid": (2, 2, 2), "reference": (-1, 2, -1)}.items():
        runs[name] = str(tmp_path / name)
        torchrun(4, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, runs[name], trainer__total_training_steps=2, data__val_files="null",
                                                        actor_rollout_ref__actor__use_kl_loss="true",
                                                        actor_rollout_ref__actor__fsdp_config__fsdp_size=actor,
                                                        actor_rollout_ref__ref__fsdp_config__fsdp_size=ref,
                                                        critic__model__fsdp_config__fsdp_size=critic, **PPO))
    full = read_metrics(runs["full"])
    for hybrid in (read_metrics(runs["hybrid"]), read_metrics(runs["reference"])):
        check_same_steps(hybrid, full)
    assert full[1]["actor/grad_norm"] > 0 and full[0]["critic/grad_norm"] > 0


def check_same_steps(hybrid: list[dict], full: list[dict]) -> None:
    assert len(hybrid) == len(full) == 2
    for h, f in zip(hybrid, full):
        assert h["critic/score/mean"] == f["critic/score/mean"] and h["response_length/mean"] == f["response_length/mean"]
        assert h.keys() == f.keys()  # the actor's metrics from step 2 (critic_warmup=1)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss", "critic/values/mean", "critic/returns/mean"):
            if key in f:
                assert h[key] == pytest.approx(f[key], abs=1e-6), key
        for key in ("actor/grad_norm", "critic/grad_norm"):
            if key in f:
                assert h[key] == pytest.approx(f[key], rel=1e-6), key


@pytest.mark.slow
def test_offload_between_phases_trains_exactly_as_without(tmp_path, tiny_llama, rl_data):
    """verl's param_offload / optimizer_offload on the actor, its reference (KL loss) and the critic: on a CPU
    device nothing moves (the next test parks on CPU what would move); the metrics are those of the run without them, bit for
    bit. (On a GPU, tests/test_cuda.py shows the device memory released.)"""
    runs = {}
    for name, extra in (("plain", {}), ("offloaded", EVERY_OFFLOAD)):
        out = str(tmp_path / name)
        torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=2, data__val_files="null",
                                                        actor_rollout_ref__actor__use_kl_loss="true", **PPO, **extra))
        runs[name] = [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))} for m in read_metrics(out)]
    assert len(runs["plain"]) == 2 and "actor/kl_loss" in runs["plain"][1]
    assert runs["offloaded"] == runs["plain"]


def test_offload_parks_fsdp2_shards_and_adamw_state_in_host_buffers(tiny_llama):
    """What a departure does on a GPU, here on three CPU processes (uneven shards, so FSDP2's padding is parked
    too): the parameter shards' and AdamW's storages are freed and their bytes come back bit for bit; three steps
    with the parking equal three without (tests/checks/offload_check.py, which test_cuda.py runs on nccl)."""
    result = torchrun(3, "tests.checks.offload_check", [tiny_llama])
    assert "offload check passed" in result.stdout


@pytest.mark.slow
def test_a_ppo_run_warms_the_critic_up_reports_it_and_checkpoints_it(ppo_straight):
    """critic_warmup=1, the critic's shards in host memory between uses (cpu_offload), three steps."""
    metrics = read_metrics(ppo_straight)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        for key in CRITIC_METRICS:
            assert key in m, key
        assert m["critic/lr"] == pytest.approx(1e-3) and m["critic/grad_norm"] > 0
        assert abs(m["critic/advantages/mean"]) < 1e-5  # whitened over the batch's response tokens
    # trainer.critic_warmup=1: the first step trains the critic only; the policy starts at the second
    assert "actor/pg_loss" not in metrics[0] and "timing_s/update_actor" not in metrics[0]
    assert all("actor/pg_loss" in m and m["actor/grad_norm"] > 0 for m in metrics[1:])
    # the critic learns the returns of this reward (the share of "e"): its error shrinks from the random head's
    assert metrics[-1]["critic/vf_loss"] < metrics[0]["critic/vf_loss"]
    step = os.path.join(ppo_straight, "global_step_3")
    assert sorted(os.listdir(os.path.join(step, "critic"))) == ["model", "optimizer"]
    with open(os.path.join(step, "meta.json")) as f:
        assert json.load(f)["companions"] == ["critic"]


@pytest.mark.slow
def test_a_ppo_run_resumes_exactly(tmp_path, tiny_llama, rl_data, ppo_straight):
    """Two steps, then the third resumed from the second's checkpoint (the critic, its optimizer and schedule):
    the third step's numbers are the uninterrupted run's."""
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=2, trainer__save_freq=2,
                                                    data__val_files="null", **PPO))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=3, data__val_files="null", **PPO))
    resumed, reference = read_metrics(out), read_metrics(ppo_straight)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for key in ("critic/score/mean", "critic/values/mean", "critic/returns/mean", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                "critic/vf_explained_var", "actor/pg_loss", "actor/grad_norm", "critic/advantages/max"):
        assert resumed[2][key] == pytest.approx(reference[2][key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_a_grpo_checkpoint_is_not_resumed_as_ppo(tmp_path, tiny_llama, rl_data):
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=1, trainer__save_freq=1,
                                                    data__val_files="null"))
    result = torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, data__val_files="null", **PPO), check=False)
    assert result.returncode != 0 and "holds the trained models ['actor'], this run trains ['actor', 'critic']" in result.stderr


@pytest.mark.slow
def test_the_preferred_token_rises_under_ppo(tmp_path, tokenizer, tiny_llama, rl_data):
    """One response per prompt, advantages from the critic alone: on a tiny Llama whose large initial weights
    make its samples peaked, rewarded for the share of 'e' in what it writes, the mean score of the last three of
    ten steps is above that of the first three (two of them the critic's warm-up). The critic is another model
    (critic.model.path: a tiny Llama of ordinary initial weights, whose first values are near 0)."""
    model = save_tiny_model(tmp_path / "peaked", "llama", tokenizer, initializer_range=1.0)
    out = str(tmp_path / "run")
    sizes = dict(data__train_batch_size=32, trainer__critic_warmup=2, actor_rollout_ref__actor__ppo_mini_batch_size=32,
                 actor_rollout_ref__actor__optim__lr="2e-2", critic__model__path=tiny_llama, critic__optim__lr="3e-3", critic__ppo_mini_batch_size=8,
                 trainer__total_training_steps=10, data__val_files="null", data__shuffle="true")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(model, rl_data, out, **{**PPO, **sizes}))
    metrics = read_metrics(out)
    scores = [m["critic/score/mean"] for m in metrics]
    assert sum(scores[-3:]) > 1.15 * sum(scores[:3]), scores
    assert metrics[-1]["critic/vf_loss"] < 0.1 * metrics[0]["critic/vf_loss"]


def ppo_example(name: str, model: str, data: Path, out: str) -> list[str]:
    """verl's example `name` with the launcher, model, paths and sizes changed (one rollout engine per process)."""
    local = {**sizes_and_paths(model, data, out), "critic.model.path": model, "critic.ppo_micro_batch_size_per_gpu": 2,
             "actor_rollout_ref.rollout.tensor_model_parallel_size": 1}
    return with_local(script_overrides(EXAMPLES / name), local)


@pytest.mark.parametrize("name", ["run_deepseek7b_llm.sh", "run_qwen2.5-0.5b.sh"])
def test_verls_ppo_examples_load_with_every_key_known(tmp_path, capsys, name):
    overrides, problems = translate(ppo_example(name, "/models/x", tmp_path, str(tmp_path)), "grpo", 2)
    assert problems == []
    assert "critic.model.fsdp_config.param_offload=False" in overrides and "critic.model.fsdp_config.optimizer_offload=False" in overrides
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=overrides))
    assert derive(config).uses_critic and config.critic.optim.lr == 1e-5 and config.critic.model.path == "/models/x"


def test_ppo_settings_that_cannot_work_are_named():
    def load(*overrides):
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            return read_grpo_config(compose(config_name="grpo_trainer", overrides=["data.train_files=x.parquet", "actor_rollout_ref.model.path=m",
                                                                                   *overrides]), world=World(0, 1, 1, torch.device("cpu")))

    with pytest.raises(ConfigError) as error:
        load("algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2", "algorithm.lam=1.5", "critic.cliprange_value=0")
    for key in ("critic.ulysses_sequence_parallel_size (2) must equal", "algorithm.lam must be in [0, 1]", "critic.cliprange_value"):
        assert key in str(error.value), key
    with pytest.raises(ConfigError, match="trainer.critic_warmup=2 without a critic"):
        load("trainer.critic_warmup=2")
    with pytest.raises(ConfigError, match="critic.enable=true with algorithm.adv_estimator=grpo"):
        load("critic.enable=true")
    with pytest.raises(ConfigError, match="algorithm.filter_groups keeps the groups whose responses differ"):
        load("algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "algorithm.filter_groups.enable=true")
    with pytest.raises(ConfigError, match="needs the critic's values"):
        load("algorithm.adv_estimator=gae", "critic.enable=false")
    assert not derive(load()).uses_critic and derive(load("algorithm.adv_estimator=gae")).uses_critic
