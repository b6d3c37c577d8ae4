"""Run under torchrun by test_ppo.py: the critic's values and one mini-batch's value-loss gradient, for every
aggregation mode, written by rank 0 to OUT so that layouts (ranks, micro-batch size, packing, Ulysses) can be
compared; and both checked here against a plain transformers model with the critic's weights on one process (its
values by a forward of each whole sequence, its token-mean gradient by verl's value loss written out here).

    python -m torch.distributed.run --nproc_per_node=N -m tests.checks.critic_check MODEL_DIR OUT MICRO PACKED SP

MICRO is sequences per micro-batch, or `default` (packed rows filled to a token budget); SP the Ulysses group size.
"""

import sys

import torch
from hydra import compose, initialize_config_module
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForTokenClassification

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import world_from_environment
from fsdptrain.rl.core_algos import LOSS_AGG_MODES
from fsdptrain.rl.critic import value_backward
from fsdptrain.trainer.grpo import build_critic, critic_model_config
from fsdptrain.trainer.grpo_plan import critic_batching, plan_grpo
from fsdptrain.trainer.setup import end_run, start_run
from tests.checks.common import relative_gap, two_groups

CLIP = 0.1


def config(model_dir: str, micro: str, packed: str, sp: str, *overrides: str):
    layout = [] if micro == "default" else [f"critic.ppo_micro_batch_size_per_gpu={micro}", "critic.use_dynamic_bsz=false"]
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        return load_grpo_config(compose(config_name="grpo_trainer", overrides=[
            "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model_dir}", "trainer.device=cpu", "algorithm.adv_estimator=gae",
            "actor_rollout_ref.rollout.n=1", "critic.model.enable_gradient_checkpointing=false", f"actor_rollout_ref.model.use_remove_padding={packed}",
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}", f"critic.cliprange_value={CLIP}", "data.max_response_length=12",
            *layout, *overrides]))


def reference_model(model_dir: str, state: dict) -> torch.nn.Module:
    hf_config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    hf_config.classifier_dropout = 0.0  # transformers 5 drops it as a keyword of from_pretrained
    model = AutoModelForTokenClassification.from_config(hf_config, dtype=torch.float32)
    model.load_state_dict(state)
    return model


def reference_values(model: torch.nn.Module, sample: Sample) -> torch.Tensor:
    """Values aligned with the tokens: token t's is the head's output at position t - 1."""
    outputs = model(input_ids=sample.input_ids[None]).logits[0, :, 0]
    return torch.cat([torch.zeros(1), outputs[:-1]])


def reference_gradient(model: torch.nn.Module, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """verl's token-mean value loss over all eight sequences, each forwarded whole, on one process."""
    model.zero_grad()
    tokens = sum(float(s.loss_mask[1:].sum()) for s in samples)
    for sample in samples:
        vpreds, mask = reference_values(model, sample), sample.loss_mask.float()
        old, returns = sample.token_values["values"], sample.token_values["returns"]
        clipped = torch.max(torch.min(vpreds, old + CLIP), old - CLIP)
        loss = torch.max((vpreds - returns) ** 2, (clipped - returns) ** 2)
        (0.5 * (loss * mask).sum() / tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def main() -> None:
    model_dir, out, micro, packed, sp = sys.argv[1:6]
    base = config(model_dir, micro, packed, sp)
    parallel = start_run(base.trainer, sp_size=int(sp))
    plan = plan_grpo(base, world_from_environment("cpu"), pad_id=0)
    critic = build_critic(plan, parallel, total_steps=1, hf_config=critic_model_config(plan.critic_model, 1000, plan.sp_size))
    # two prompts' groups of four, with returns on their response tokens
    everything = two_groups(lambda g, prompt, response, mask: {"returns": torch.randn(prompt + response, generator=g) * mask})
    mine = everything[parallel.dp_rank :: parallel.dp_size]
    critic.values(mine)
    gathered = [None] * parallel.world_size  # every rank's values, for the reference and for the other ranks' samples
    torch.distributed.all_gather_object(gathered, (parallel.dp_rank, [s.token_values["values"] for s in mine]))
    for dp_rank, rank_values in gathered:
        for sample, sample_values in zip(everything[dp_rank :: parallel.dp_size], rank_values):
            sample.token_values["values"] = sample_values
    state = get_model_state_dict(critic.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    reference = reference_model(model_dir, state) if parallel.is_main else None
    if parallel.is_main:
        with torch.no_grad():
            for sample in everything:
                expected = reference_values(reference, sample) * sample.loss_mask
                torch.testing.assert_close(sample.token_values["values"], expected, atol=1e-5, rtol=0)
    for sample, index in zip(everything, range(8)):  # old values off the current ones, both sides of the clip
        noise = torch.randn(len(sample), generator=torch.Generator().manual_seed(100 + index)) * 0.2
        sample.token_values["values"] = sample.token_values["values"] + noise * sample.loss_mask

    gradients = {}
    for agg_mode in LOSS_AGG_MODES:
        variant = config(model_dir, micro, packed, sp, f"critic.loss_agg_mode={agg_mode}")
        critic.model.zero_grad(set_to_none=True)
        loss_settings = type(critic.loss)(CLIP, agg_mode, None, variant.data.max_response_length)
        sums = value_backward(critic.model, mine, critic_batching(variant, forward=False), critic.forward, loss_settings, parallel)
        assert sums["vf_clipfrac"] > 0 or sums["tokens"] == 0
        gradients[agg_mode] = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                               for name, p in critic.model.named_parameters()}
    if parallel.is_main:
        gap = relative_gap(gradients["token-mean"], reference_gradient(reference, everything))
        assert gap < 5e-6, f"{gap:.2e} of the reference gradient's norm"
        torch.save(gradients, out)
    end_run()
    print("ok", parallel.rank)


if __name__ == "__main__":
    main()
