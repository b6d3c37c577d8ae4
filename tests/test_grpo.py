"""The GRPO trainer through its real CLI under torchrun (gloo, CPU): a mini-batch's gradient whatever the layout,
a full run with every metric, its rollout dump and checkpoint, resume, and learning. (Its config rules are in
test_config.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checks.common import relative_gap
from conftest import REPO, REWARD, read_metrics, save_tiny_model, torchrun, validated_at_the_last_step

TOLERANCE = 5e-6  # of the gradient's norm


@pytest.mark.slow
def test_a_mini_batch_gradient_is_the_same_whatever_the_layout(tmp_path, ids_llama):
    """Every policy loss (but those that read their micro-batch's statistics) with token-mean and
    seq-mean-token-mean, every aggregation mode with the default loss, the SFT term, and on-policy distillation's
    losses (the teacher's top-k, k1 as the policy gradient's reward, k3 beside the task's loss, which the check
    finds to be the sum of the two) (fp32): one process with micro-batches of 8 packed sequences (each
    group's prompt held once), against two processes with micro-batches of 1 padded sequence (every prompt with
    each response), at the defaults (packed rows cut by a token budget, sharing prompts), and as one Ulysses
    group of two that each hold a slice of every sequence (not sharing), and two such groups side by side (dp 2 x
    sp 2, where the skipped groups' deal runs over the data-parallel ranks and each Ulysses rank computes the same)."""
    layouts = {"dp1-micro8-packed": (1, 8, "true", 1), "dp2-micro1-padded": (2, 1, "false", 1), "dp2-defaults": (2, "default", "true", 1),
               "sp2-micro3-packed": (2, 3, "true", 2), "dp2-sp2-micro3-packed": (4, 3, "true", 2)}
    gradients = {}
    for name, (nproc, micro, packed, sp) in layouts.items():
        out = str(tmp_path / f"{name}.pt")
        torchrun(nproc, "tests.checks.grpo_check", [ids_llama, out, str(micro), packed, str(sp)])
        gradients[name] = torch.load(out)
    reference = gradients.pop("dp1-micro8-packed")
    assert "vanilla token-mean" in reference and "geo_mean seq-mean-token-sum" in reference
    for layout, runs in gradients.items():
        assert runs.keys() == reference.keys()
        for combination, grads in runs.items():
            gap = relative_gap(grads, reference[combination])
            # fp32: another packing changes the shapes of every matmul, and so the order of its sums; repacking
            # alone, in one process with full logits, moves this gradient by 2.4e-6 of its norm
            assert gap < TOLERANCE, f"{layout} {combination}: {gap:.2e} of the gradient's norm"


def grpo_args(model: str, data: Path, out: str, **overrides) -> list[str]:
    args = {
        "data.train_files": str(data / "rl_train.parquet"), "data.val_files": str(data / "rl_val.parquet"),
        "data.max_prompt_length": 96, "data.max_response_length": 8, "data.train_batch_size": 4, "data.shuffle": "false",
        "actor_rollout_ref.model.path": model, "actor_rollout_ref.model.enable_gradient_checkpointing": "false",
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.optim.lr": "1e-3",
        "actor_rollout_ref.rollout.n": 4, "custom_reward_function.path": str(data / "reward.py"),
        "trainer.total_training_steps": 2, "trainer.logger": "[file]", "trainer.default_local_dir": out, "trainer.device": "cpu",
    }
    args.update({k.replace("__", "."): v for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in validated_at_the_last_step(args).items()]


METRICS = [
    "critic/score/mean", "critic/score/max", "critic/score/min", "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/max",
    "critic/advantages/min", "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "prompt_length/mean", "prompt_length/max", "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
    "actor/entropy", "actor/kl_loss", "actor/kl_coef", "actor/grad_norm", "actor/lr", "frac_reward_zero_std", "timing_s/gen",
    "timing_s/reward", "timing_s/ref", "timing_s/adv", "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
    "perf/throughput", "perf/max_memory_gb",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_llama, rl_data):
    out = str(tmp_path_factory.mktemp("grpo"))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, actor_rollout_ref__actor__use_kl_loss="true",
                                                    trainer__test_freq=2, trainer__rollout_data_dir=f"{out}/rollouts",
                                                    trainer__logger="[file,tensorboard]", trainer__plot_freq=1,
                                                    reward_model__overlong_buffer__enable="true", reward_model__overlong_buffer__len=4,
                                                    algorithm__use_kl_in_reward="true", algorithm__kl_ctrl__type="adaptive",
                                                    algorithm__kl_ctrl__horizon=10, algorithm__kl_ctrl__target_kl=1e-6,
                                                    trainer__save_freq=2, trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]",
                                                    trainer__profile_step=2))
    return out


@pytest.mark.slow
@pytest.mark.slow
def test_a_reference_in_bf16_beside_an_fp32_actor_is_the_model_rounded_to_bf16(tmp_path, tiny_llama, rl_data, straight):
    """actor_rollout_ref.ref.fsdp_config.model_dtype=bf16 (verl's LoRA examples set it): the reference holds the
    pretrained weights rounded to bf16 and computes in the actor's fp32. Step 1's KL loss (the actor still the
    pretrained model) is low_var_kl between a plain transformers model and its bf16-rounded copy over the dumped
    responses, token-mean; with the reference in fp32 (`straight`) it is 0."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=1, data__val_files="null",
                                                    actor_rollout_ref__actor__use_kl_loss="true", trainer__rollout_data_dir=f"{out}/rollouts",
                                                    actor_rollout_ref__ref__fsdp_config__model_dtype="bf16"))
    policy = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).to(torch.bfloat16)
    for parameter in reference.parameters():  # FSDP2 gathers the bf16 shards into the compute dtype; buffers stay bf16
        parameter.data = parameter.data.float()

    def log_probs(model, row: dict) -> torch.Tensor:
        ids = torch.tensor(row["prompt_ids"] + row["response_ids"])
        with torch.no_grad():
            logits = model(ids[None]).logits[0, len(row["prompt_ids"]) - 1 : -1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(row["response_ids"])[:, None]).squeeze(1)

    total, tokens = 0.0, 0
    for row in map(json.loads, open(f"{out}/rollouts/1.jsonl")):
        reverse = log_probs(reference, row) - log_probs(policy, row)
        total += float((torch.exp(reverse) - reverse - 1).clamp(-10, 10).sum())
        tokens += len(row["response_ids"])
    logged = read_metrics(out)[0]["actor/kl_loss"]
    assert logged == pytest.approx(total / tokens, rel=1e-3) and logged > 1e-8  # a random tiny model's near-uniform log-probs: small
    assert abs(read_metrics(straight)[0]["actor/kl_loss"]) < 1e-3 * logged


@pytest.mark.slow
def test_a_run_writes_every_metric_the_rollouts_and_a_checkpoint(straight):
    metrics = read_metrics(straight)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in METRICS:
        assert all(key in m for m in metrics), key
    assert "val-core/arithmetic/acc/mean@1" in metrics[-1] and "val-core/arithmetic/reward/mean@1" in metrics[-1]
    # The reward's KL needs the old policy's log-probs first; they equal the updating pass's to float precision.
    assert all(abs(m["actor/ppo_kl"]) < 1e-6 for m in metrics)
    # At step 1 the old policy is the reference (KL 0); at step 2 the reward carries the KL penalty.
    assert metrics[0]["critic/rewards/mean"] == metrics[0]["critic/score/mean"] and metrics[0]["actor/reward_kl_penalty"] == 0.0
    assert metrics[1]["critic/rewards/mean"] != metrics[1]["critic/score/mean"] and metrics[1]["actor/reward_kl_penalty"] != 0.0
    rows = [json.loads(line) for line in open(os.path.join(straight, "rollouts", "2.jsonl"))]
    assert len(rows) == 16 and {"prompt", "response", "score", "acc", "length", "advantage", "ground_truth"} <= set(rows[0])
    # DAPO's overlong penalty: 4 tokens past max_response_length - len(buffer) = 4 at the 8-token limit costs 1
    for row in rows:
        assert row["overlong_penalty"] == pytest.approx(min(-(row["response_length"] - 4) / 4, 0.0))
    assert os.path.isfile(os.path.join(straight, "global_step_2", "huggingface", "model.safetensors"))
    profile = os.path.join(straight, "profile")
    assert sorted(os.listdir(profile)) == [f"step2_rank{r}.{ext}" for r in (0, 1) for ext in ("json", "txt")]
    with open(os.path.join(profile, "step2_rank0.txt")) as f:
        assert "aten::" in f.read()  # an operator table of the step


@pytest.mark.slow
def test_plots_are_written_and_sent_to_tensorboard(straight):
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("score", "val_acc", "response_length", "response_length_hist"):
        image = imread(os.path.join(straight, "plots", f"{name}.png"))
        assert image.shape[0] > 100 and image.std() > 0, name  # a drawn picture, not an empty canvas
    events = EventAccumulator(os.path.join(straight, "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert {"plots/score", "plots/response_length", "plots/response_length_hist"} <= set(events.Tags()["images"])
    assert [e.step for e in events.Images("plots/score")] == [1, 2]
    # The step curves again from the metrics file, as for a run stopped before its end.
    redrawn = subprocess.run([sys.executable, "-m", "fsdptrain.logging.plots", os.path.join(straight, "metrics.jsonl"), os.path.join(straight, "again")],
                             cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    assert [os.path.basename(p) for p in redrawn] == ["score.png", "response_length.png", "val_acc.png"]
    assert imread(redrawn[0]).shape == imread(os.path.join(straight, "plots", "score.png")).shape


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path, tiny_llama, rl_data, straight):
    out = str(tmp_path)
    common = dict(actor_rollout_ref__actor__use_kl_loss="true", trainer__save_freq=1, reward_model__overlong_buffer__enable="true",
                  reward_model__overlong_buffer__len=4, algorithm__use_kl_in_reward="true", algorithm__kl_ctrl__type="adaptive",
                  algorithm__kl_ctrl__horizon=10, algorithm__kl_ctrl__target_kl=1e-6)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=1, **common))
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, **common))
    resumed, reference = read_metrics(out), read_metrics(straight)
    assert [m["step"] for m in resumed] == [1, 2]
    # The adaptive KL coefficient moved at step 1 and was checkpointed: step 2 starts from the moved value.
    # (KL 0 at step 1, under the target: error -1, clipped to -0.2, times 16 sequences / horizon 10)
    assert resumed[1]["actor/reward_kl_penalty_coeff"] == pytest.approx(resumed[0]["actor/reward_kl_penalty_coeff"] * (1 - 0.2 * 16 / 10))
    for key in ("critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm",
                "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):
        assert resumed[1][key] == pytest.approx(reference[1][key], rel=1e-5, abs=1e-7), key


PARITY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # even answers: the same acc for every response (a group that teaches nothing); odd: acc by response length
    acc = 1.0 if int(ground_truth) % 2 == 0 else float(len(solution_str) % 2)
    return {"score": solution_str.count("e") / max(len(solution_str), 1), "acc": acc}
"""


@pytest.mark.slow
def test_sequence_parallel_dynamic_sampling_and_rollout_correction(tmp_path, tiny_llama, rl_data):
    """One Ulysses group of two ranks; DAPO's dynamic sampling on `acc` keeps only the groups where it varies and
    draws again until it has train_batch_size of them (max_num_gen_batches=0: no limit, verl's default); token-level rollout correction with the HF engine's
    sampling log-probs, which are the trainer's (weights 1, normalized by a mean of 1, probabilities equal, no
    token rejected); the reward function under newer verl's key."""
    reward = tmp_path / "parity.py"
    reward.write_text(PARITY_REWARD)
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(
        tiny_llama, rl_data, out, actor_rollout_ref__actor__ulysses_sequence_parallel_size=2, algorithm__filter_groups__enable="true",
        algorithm__filter_groups__metric="acc", algorithm__filter_groups__max_num_gen_batches="0", algorithm__rollout_correction__rollout_is="token",
        algorithm__rollout_correction__rollout_is_batch_normalize="true", algorithm__rollout_correction__rollout_rs="'token_k1,seq_max_k2'",
        algorithm__rollout_correction__rollout_rs_threshold="'0.5_2.0,0.5'", custom_reward_function__path="null",
        reward__custom_reward_function__path=str(reward), trainer__rollout_data_dir=f"{out}/rollouts", data__val_files="null"))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m["train/num_gen_batches"] for m in metrics) > 2  # some batch fell short: about half the groups are dropped
    for step in (1, 2):
        rows = [json.loads(line) for line in open(os.path.join(out, "rollouts", f"{step}.jsonl"))]
        assert len(rows) == 16
        for first in range(0, 16, 4):
            group = rows[first : first + 4]
            assert int(group[0]["ground_truth"]) % 2 == 1 and len({r["acc"] for r in group}) > 1, group
    for m in metrics:
        assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m["rollout_corr/rollout_is_capped_fraction"] == 0.0
        assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(1.0, abs=1e-4)
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and m["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert abs(m["rollout_corr/kl"]) < 1e-5
        assert m["actor/grad_norm"] > 0


@pytest.mark.slow
def test_dynamic_sampling_that_runs_out_of_batches_names_the_key(tmp_path, tiny_llama, rl_data):
    """Every group scored alike (a constant reward) leaves dynamic sampling nothing to keep: after
    max_num_gen_batches the run ends with the user's message, once, without a traceback (under torchrun)."""
    reward = tmp_path / "constant.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    result = torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, str(tmp_path / "run"), algorithm__filter_groups__enable="true",
                                                             algorithm__filter_groups__max_num_gen_batches=2, custom_reward_function__path=str(reward),
                                                             data__val_files="null"), check=False, extra=["--max-restarts=0"])
    assert result.returncode == 1
    workers = result.stderr[: result.stderr.find("torch/distributed/elastic")]  # before torchrun's own summary
    assert "Traceback" not in workers, result.stderr[-3000:]
    assert workers.count("algorithm.filter_groups: 0 groups with varying acc after max_num_gen_batches=2 batches") == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_truncated_completions_can_be_left_out_of_the_loss(tmp_path, tiny_llama, rl_data):
    """Responses cut at 4 tokens (the tiny model never ends one earlier) with mask_truncated_completions: nothing
    is trained, so the gradient is 0."""
    out = str(tmp_path)
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, data__max_response_length=4, trainer__total_training_steps=1,
                                                    actor_rollout_ref__actor__mask_truncated_completions="true", data__val_files="null"))
    (metrics,) = read_metrics(out)
    assert metrics["response_length/clip_ratio"] == 1.0
    assert metrics["actor/grad_norm"] == 0.0 and metrics["actor/pg_loss"] == 0.0


@pytest.mark.slow
def test_responses_without_advantage_are_skipped_with_the_same_update(tmp_path, tiny_llama, rl_data):
    """actor.skip_zero_advantage through the CLI: a reward that is 0 for every response of an odd answer's prompt,
    so those groups have no advantage. One step with and without skipping: the same gradient norm and the same
    weights after it; the engine's log-probs are compared with those of the responses the update forwarded."""
    reward = rl_data / "even_reward.py"
    reward.write_text(REWARD.replace("def compute_score", "def share_of_e") + """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return share_of_e(data_source, solution_str, ground_truth)["score"] * (int(ground_truth) % 2 == 0)
""")
    runs = {}
    for skip in ("false", "true"):
        out = str(tmp_path / skip)
        torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__total_training_steps=1, data__val_files="null",
                                                        custom_reward_function__path=str(reward), actor_rollout_ref__actor__skip_zero_advantage=skip,
                                                        actor_rollout_ref__rollout__calculate_log_probs="true",
                                                        trainer__save_freq=1, trainer__checkpoint__save_contents="[hf_model]"))
        (metrics,) = read_metrics(out)
        runs[skip] = metrics, load_file(os.path.join(out, "global_step_1", "huggingface", "model.safetensors"))
    (every, weights), (skipped, skipped_weights) = runs["false"], runs["true"]
    assert 0 < every["frac_reward_zero_std"] < 1, every["frac_reward_zero_std"]
    assert skipped["actor/grad_norm"] == pytest.approx(every["actor/grad_norm"], rel=1e-5)
    for name, tensor in weights.items():
        torch.testing.assert_close(skipped_weights[name], tensor, rtol=0, atol=1e-6)
    assert skipped["training/rollout_probs_diff_mean"] < 1e-5


@pytest.mark.slow
def test_the_preferred_token_rises(tmp_path, tokenizer, rl_data):
    """A tiny Llama whose large initial weights make its samples peaked, rewarded for the share of 'e' in what it
    writes: the mean score rises within fourteen steps (on some CPUs it stays flat for the first six). With one
    mini-batch the engine's sampling log-probs are compared with the update's own forward (no old-policy pass), and
    they agree at every step."""
    model = save_tiny_model(tmp_path / "peaked", "llama", tokenizer, initializer_range=1.0)
    out = str(tmp_path / "run")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(model, rl_data, out, data__train_batch_size=8, actor_rollout_ref__actor__ppo_mini_batch_size=8,
                                                    actor_rollout_ref__rollout__n=8, actor_rollout_ref__actor__optim__lr="2e-2",
                                                    actor_rollout_ref__rollout__calculate_log_probs="true",
                                                    trainer__total_training_steps=14, data__val_files="null", data__shuffle="true"))
    metrics = read_metrics(out)
    scores = [m["critic/score/mean"] for m in metrics]
    assert sum(scores[-2:]) > 1.15 * sum(scores[:2]), scores
    for m in metrics:
        assert "timing_s/old_log_prob" not in m
        # This model's large weights make large logits: cached generation and a whole forward round apart by up to
        # 1e-4 in probability at a few tokens; a stale or misaligned log-prob is off by far more.
        assert m["training/rollout_probs_diff_mean"] < 1e-5 and m["training/rollout_probs_diff_max"] < 1e-3


def test_rollout_sampling_log_probs_are_the_policys_at_the_temperature(tiny_llama):
    """The HF engine's sampling log-probs (calculate_log_probs) equal log-softmax(logits / T) of a plain forward
    pass over prompt + response; without the key none are kept."""
    from transformers import AutoModelForCausalLM

    from fsdptrain.rl.rollout.hf import HFRollout

    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    torch.manual_seed(0)
    prompts = [[5, 17, 42, 99], [7, 8]]
    generations = engine.generate(prompts, n=2, max_new_tokens=6, batch_size=4, temperature=0.7, calculate_log_probs=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    for generation in generations:
        ids = torch.tensor([generation.prompt_ids + generation.response_ids])
        logits = model(ids).logits[0, len(generation.prompt_ids) - 1 : -1] / 0.7
        expected = logits.log_softmax(-1).gather(1, torch.tensor(generation.response_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(generation.log_probs), expected, rtol=1e-5, atol=1e-5)
    assert all(g.log_probs is None for g in engine.generate(prompts, n=1, max_new_tokens=3, batch_size=2))
