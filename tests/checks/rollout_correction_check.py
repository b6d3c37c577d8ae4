"""Run under torchrun (2 ranks, each holding every other response) by test_verl_equivalence.py: rollout correction
as the trainer applies it (rollout_agreement: importance weights normalized over every rank's batch, rejected
tokens out of the loss masks and the advantages' response masks) against verl 0.9.1's
compute_rollout_correction_weights and compute_rollout_rejection_mask on the whole batch, in every rejection
option and threshold form verl's helper takes.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.checks.rollout_correction_check
"""

import torch

from fsdptrain.config.grpo import RS_OPTIONS, importance_bounds, rejection_options
from fsdptrain.distributed.mesh import init_parallel
from fsdptrain.rl.core_algos import RejectionRule
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.rollout_correction import Correction, rollout_agreement
from fsdptrain.rl.samples import aligned, make_samples
from tests.checks.verl_reference import load_verl

PROMPT = [1, 2, 3]
# (rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
CASES = [
    ("token", 1.5, True, "token_k1,seq_max_k2", "0.7_1.4,0.08"),
    ("sequence", 3.0, True, "seq_sum_k1,seq_mean_k3", "0.4_2.5,0.01"),
    ("token", "0.6_1.6", True, ",".join(option for option in RS_OPTIONS if not option.endswith("k1")), "0.6"),
    ("sequence", "0.3_3.0", False, "token_k1,seq_mean_k1,seq_mean_k1", "1.5"),  # k1's upper alone; an option named twice
    (None, 2.0, False, "seq_sum_k2,token_k3", 0.4),
]


def padded_batch(seed: int, rows: int = 12, width: int = 9):
    """Old and rollout log-probs of `rows` responses of uneven lengths, right-padded (the last row masked out
    entirely, as a multi-turn response of tool tokens alone), the engine's gap to the old policy growing row by row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[-1] = 0
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    old = -torch.rand(rows, width, generator=g) * 3
    rollout = old + torch.randn(rows, width, generator=g) * torch.linspace(0.05, 0.8, rows)[:, None]
    return old, rollout, mask


def main() -> None:
    parallel = init_parallel("cpu", 1)
    verl = load_verl("verl.trainer.ppo.rollout_corr_helper")
    for seed, (level, is_threshold, normalize, options, rs_threshold) in enumerate(CASES):
        old, rollout, mask = padded_batch(seed)
        expected_mask, verl_metrics = verl.compute_rollout_rejection_mask(old - rollout, mask, options, rs_threshold)
        assert 0 < verl_metrics["rollout_rs_masked_fraction"] < 1, (options, verl_metrics)  # the case rejects some tokens, not all
        mine = range(parallel.rank, len(mask), parallel.world_size)
        generations = [Generation(PROMPT, [7] * mask.shape[1], mask[i].long().tolist(), rollout[i].tolist(), False) for i in mine]
        samples = make_samples(generations, mask_truncated=False)
        for sample, i in zip(samples, mine):
            sample.token_values["old_log_prob"] = aligned(old[i], len(PROMPT))
        upper, lower = importance_bounds(is_threshold)
        correction = Correction(level, upper, lower, normalize, tuple(RejectionRule(*r) for r in rejection_options(options, rs_threshold)))
        metrics, trained = rollout_agreement(samples, generations, correction, parallel)

        for sample, generation, i in zip(samples, trained, mine):
            assert generation.response_mask == expected_mask[i].long().tolist(), (options, i)
            assert sample.loss_mask[len(PROMPT):].tolist() == expected_mask[i].long().tolist(), (options, i)
            assert float(sample.token_values["sequence_tokens"][0]) == float(expected_mask[i].sum())
        assert abs(metrics["rollout_corr/rollout_rs_masked_fraction"] - verl_metrics["rollout_rs_masked_fraction"]) < 1e-6
        assert abs(metrics["rollout_corr/rollout_rs_seq_masked_fraction"] - verl_metrics["rollout_rs_seq_masked_fraction"]) < 1e-6
        if level is None:
            assert all("rollout_is_weight" not in s.token_values for s in samples)
            continue
        expected_weights, verl_is = verl.compute_rollout_correction_weights(old - rollout, mask, level, is_threshold, normalize)
        for sample, i in zip(samples, mine):
            torch.testing.assert_close(sample.token_values["rollout_is_weight"][len(PROMPT):], expected_weights[i], rtol=1e-6, atol=1e-6)
        if normalize:
            assert abs(metrics["rollout_corr/rollout_is_batch_norm_factor"] - verl_is["rollout_is_batch_norm_factor"]) < 1e-6
    if parallel.rank == 0:
        print(f"rollout correction equals verl's on {len(CASES)} cases")


if __name__ == "__main__":
    main()
