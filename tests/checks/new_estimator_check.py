"""A GRPO run with an advantage estimator registered here, of a kind core_algos has none of: the critic's values
compared within each prompt's group (each response's score less the mean of its group's first-token values), the
critic learning each token's reward-to-go. Its declaration alone (a critic's values, two responses a prompt) makes
the plan build the critic; `python -m tests.checks.new_estimator_check ARGS` runs as the trainer with ARGS."""

import runpy

import torch

from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS, EstimatorBatch, EstimatorInfo, reward_to_go


@ADVANTAGE_ESTIMATORS.register("group_value_baseline", info=EstimatorInfo(needs_values=True, min_group_size=2))
def group_value_baseline(batch: EstimatorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's score less its group's mean first-token value, on every token; returns the reward-to-go."""
    first_values = batch.values[:, 0]
    baseline = torch.stack([first_values[batch.group_ids == group].mean() for group in batch.group_ids])
    print(f"group_value_baseline: {len(batch.mask)} responses, {len(batch.group_ids.unique())} groups, values {tuple(batch.values.shape)}")
    return (batch.token_rewards.sum(-1) - baseline)[:, None] * batch.mask, reward_to_go(batch.token_rewards, batch.mask)


if __name__ == "__main__":
    runpy.run_module("fsdptrain.grpo_trainer", run_name="__main__", alter_sys=True)
