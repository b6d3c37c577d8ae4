"""Run under torchrun (2 ranks, each holding every other response of a micro-batch) by test_verl_equivalence.py:
rollout correction in bypass mode as the update computes it in each micro-batch's loss (core_algos.bypass_is_weights,
bypass_kept, the bypass loss aggregated over the kept tokens) against verl 0.9.1's own functions on the same rows:
compute_rollout_correction_weights (its batch normalization a distributed mean over both ranks),
compute_rollout_rejection_mask, and compute_policy_loss_reinforce / compute_policy_loss_vanilla with the rejection
mask, as its compute_policy_loss_bypass_mode composes them. Masks exactly; weights, losses and the gradients of the
log-probs to 1e-6.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.checks.bypass_check
"""

import torch
import torch.distributed as dist

from fsdptrain.config.grpo import RS_OPTIONS, importance_bounds, rejection_options
from fsdptrain.distributed.mesh import init_parallel
from fsdptrain.rl import core_algos
from fsdptrain.rl.core_algos import PolicyLossSettings, PolicyTokens, RejectionRule
from tests.checks.verl_reference import load_verl

# (loss_type, rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, loss_agg_mode)
CASES = [
    ("reinforce", "sequence", 2.0, True, "seq_max_k2,seq_mean_k3", "0.5,0.05", "token-mean"),  # verl's bypass example
    ("reinforce", "token", 1.5, True, "token_k1,seq_sum_k2", "0.7_1.4,0.6", "seq-mean-token-mean"),
    ("reinforce", "sequence", "0.3_3.0", True, ",".join(o for o in RS_OPTIONS if not o.endswith("k1")), "0.6", "seq-mean-token-sum"),
    ("reinforce", "token", "0.6_1.6", False, "seq_sum_k1,token_k3", "0.4_2.5,0.2", "token-mean"),
    ("ppo_clip", "sequence", 2.0, True, "token_k2,seq_max_k3", "0.1,0.3", "token-mean"),
    ("ppo_clip", None, 2.0, False, "seq_mean_k1", "0.8_1.25", "seq-mean-token-mean"),
    ("reinforce", "sequence", 2.0, True, None, None, "token-mean"),
]


class VerlActorConfig(dict):
    """What verl's policy losses read of its ActorConfig: clip ratios and the global batch's counts."""

    def __init__(self, global_batch_info: dict):
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = 0.2, 0.2, 0.28
        self.global_batch_info = global_batch_info


def micro_batch(seed: int, rows: int = 48, width: int = 12):
    """Current and rollout log-probs and advantages of `rows` right-padded responses (the last empty), the engine's gap
    to the current policy growing row by row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    lengths[-1] = 0
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    log_probs = -torch.rand(rows, width, generator=g) * 3
    rollout = log_probs + torch.randn(rows, width, generator=g) * torch.linspace(0.05, 0.6, rows)[:, None]
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    return log_probs, rollout, advantages, mask


def our_tokens(log_probs: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> PolicyTokens:
    """This rank's rows as the update's flat PolicyTokens (each row a sequence)."""
    rows, width = mask.shape
    sequence = torch.arange(rows).repeat_interleave(width)
    lengths = mask.sum(-1)[sequence]

    def sequence_mean(values):
        return core_algos.sequence_sums(values * mask.flatten(), sequence, rows)[sequence] / lengths.clamp(min=1)

    def sequence_max(values):
        return torch.full((rows,), float("-inf")).scatter_reduce(0, sequence, values, "amax")[sequence]

    def ranks_sum(values):
        values = values.clone()
        dist.all_reduce(values)
        return values

    return PolicyTokens(log_probs.flatten(), rollout.flatten(), advantages.flatten(), mask.flatten(), sequence_mean, lengths,
                        sequence_max, ranks_sum)


def main() -> None:
    parallel = init_parallel("cpu", 1)
    helper, verl = load_verl("verl.trainer.ppo.rollout_corr_helper"), load_verl("verl.trainer.ppo.core_algos")
    rank, world = parallel.rank, parallel.world_size
    for seed, (loss_type, level, is_threshold, normalize, options, rs_threshold, agg_mode) in enumerate(CASES):
        log_probs, rollout, advantages, mask = micro_batch(seed)
        mine = slice(rank, None, world)
        log_probs, rollout, advantages, mask = (t[mine].clone() for t in (log_probs, rollout, advantages, mask))
        tokens_all, sequences_all = mask.sum().clone(), (mask.sum(-1) > 0).float().sum()
        counts = torch.stack([tokens_all, sequences_all])
        dist.all_reduce(counts)

        # verl: its functions on this rank's rows, as compute_policy_loss_bypass_mode composes them
        verl_log_probs = log_probs.clone().requires_grad_()
        log_ratio = verl_log_probs.detach() - rollout
        weights = None
        if level is not None:
            weights, _ = helper.compute_rollout_correction_weights(log_ratio, mask, level, is_threshold, normalize)
        kept = mask
        if options is not None:
            kept, _ = helper.compute_rollout_rejection_mask(log_ratio, mask, options, rs_threshold)
        config = VerlActorConfig({"dp_size": world, "batch_num_tokens": float(counts[0]), "global_batch_size": float(counts[1])})
        if loss_type == "reinforce":
            verl_loss, _ = verl.compute_policy_loss_reinforce(rollout, verl_log_probs, advantages, kept, agg_mode, config, weights)
        else:
            verl_loss, _ = verl.compute_policy_loss_vanilla(rollout, verl_log_probs, advantages, kept, agg_mode, config, None)
        verl_loss.backward()

        # ours
        upper, lower = importance_bounds(is_threshold)
        rules = tuple(RejectionRule(*r) for r in rejection_options(options, rs_threshold)) if options else ()
        settings = PolicyLossSettings(clip_low=0.2, clip_high=0.28, bypass_loss_type=loss_type, rollout_is=level, rollout_is_threshold=upper,
                                      rollout_is_lower=lower, rollout_is_batch_normalize=normalize, rejection=rules)
        our_log_probs = log_probs.clone().requires_grad_()
        tokens = our_tokens(our_log_probs, rollout, advantages, mask)
        our_kept = core_algos.bypass_kept(tokens, settings) if rules else tokens.mask
        assert torch.equal(our_kept, kept.flatten()), (seed, options)
        if level is not None and loss_type == "reinforce":
            torch.testing.assert_close(core_algos.bypass_is_weights(tokens, settings), weights.flatten(), atol=1e-6, rtol=0)
        per_token, _, _ = core_algos.POLICY_LOSSES["bypass_mode"](tokens, settings)
        kept_tokens = tokens.sequence_sum(our_kept)
        loss = core_algos.agg_loss(per_token, our_kept, kept_tokens, agg_mode, float(counts[0]), float(counts[1]), mask.shape[1]) * world
        loss.backward()
        torch.testing.assert_close(loss, verl_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(our_log_probs.grad, verl_log_probs.grad, atol=1e-6, rtol=0)
        if options is not None:  # the case rejects some of the two ranks' tokens, not all
            totals = torch.stack([kept.sum(), mask.sum()])
            dist.all_reduce(totals)
            assert 0 < totals[0] < totals[1], (seed, totals)
    dist.barrier()
    if parallel.is_main:
        print(f"bypass mode equals verl's on {len(CASES)} cases")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
