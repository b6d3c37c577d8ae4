"""PPO's critic: a value head on a transformer backbone, sharded like the policy, its values of a rollout's
samples and its clipped value-loss update over mini-batches. It runs on the actor's pieces (micro-batch plans,
the empty-rank forward, the global loss aggregation, the update loop); only the head and the loss are its own.

A token's value is the head's output at the position before it (the state from which the token was generated),
as verl's critic reads `values[:, -response_length - 1 : -1]`; so values sit where log-probs sit.
"""

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim.lr_scheduler import LRScheduler

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import MicroBatching, forward_batches, plan_micro_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.models.loss import IGNORE_INDEX, with_sp_group
from fsdptrain.rl import core_algos
from fsdptrain.rl.actor import ForwardSettings, UpdateSettings, mini_batch_aggregation, run_update, store_token_values

# The value head's output comes out of its linear layer as a view; FSDP warns that an in-place op on it would skip
# its hooks. Here it is only ever indexed (a copy), so the warning says nothing about this use.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForTokenClassification\) returned a view tensor")


@dataclass(frozen=True)
class ValueLossSettings:
    """The value loss (critic.*)."""

    clip_range: float  # cliprange_value
    agg_mode: str  # a name in core_algos.LOSS_AGG_MODES
    loss_scale_factor: float | None
    max_response_length: int


def token_values(model: nn.Module, inputs: dict, labels: torch.Tensor, token_rows: torch.Tensor | None,
                 sp_group: ProcessGroup | None) -> torch.Tensor:
    """The value head's output (fp32) at each position whose label is not IGNORE_INDEX, 0 elsewhere, in the
    labels' flattened shape; `token_rows` as in models.loss.token_log_probs."""
    labels = labels.flatten()
    rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    hidden_rows = rows if token_rows is None else token_rows[rows]
    values = model(**with_sp_group(inputs, sp_group), use_cache=False).logits.flatten()[hidden_rows].float()
    return torch.zeros(len(labels), dtype=values.dtype, device=values.device).index_put((rows,), values)


def value_backward(model: nn.Module, mini: list[Sample], batching: MicroBatching, forward: ForwardSettings, loss_settings: ValueLossSettings,
                   parallel: Parallel) -> dict[str, float]:
    """Gradients of one mini-batch's value loss (this rank's samples of it, carrying their old `values` and
    their `returns`), accumulated into the parameters. Returns this rank's sums of the per-token metrics and its
    token count."""
    aggregate = mini_batch_aggregation(mini, loss_settings.agg_mode, loss_settings.loss_scale_factor, loss_settings.max_response_length,
                                       parallel)
    sums = {key: 0.0 for key in ("vf_loss", "vf_clipfrac", "vpred_mean", "tokens")}
    micro_batches = plan_micro_batches(mini, batching, parallel)
    for micro_batch, batch in forward_batches(micro_batches, mini[:1], forward.packed, forward.pad_id, parallel, forward.share_prompts):
        targets = {k: v.flatten() for k, v in batch.targets.items()}
        mask = (targets["labels"] != IGNORE_INDEX).float() * (0.0 if micro_batch is None else 1.0)
        values = token_values(model, batch.inputs, targets["labels"], batch.token_rows, parallel.ulysses_group)
        loss, clipped = core_algos.value_loss(values, targets["values"], targets["returns"], mask, loss_settings.clip_range)
        (aggregate(loss, mask=mask, sequence_tokens=targets["sequence_tokens"]) * parallel.world_size).backward()  # FSDP averages
        sums["vf_loss"] += float((loss.detach() * mask).sum())
        sums["vf_clipfrac"] += float(clipped.sum())
        sums["vpred_mean"] += float((values.detach() * mask).sum())
        sums["tokens"] += float(mask.sum())
    return sums


@dataclass
class Critic:
    model: nn.Module  # a token-classification model with one label: the value head
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    parallel: Parallel
    forward: ForwardSettings  # its packing and prompt sharing; it has no temperature or chunked head
    loss: ValueLossSettings
    update_settings: UpdateSettings
    micro_batching: MicroBatching  # the update's forward passes
    values_batching: MicroBatching  # critic.forward_micro_batch_size_per_gpu's

    @torch.no_grad()
    def values(self, samples: Sequence[Sample]) -> None:
        """Each sample's values of its response tokens, stored as its token values `values`."""
        micro_batches = plan_micro_batches(list(samples), self.values_batching, self.parallel)
        for micro_batch, batch in forward_batches(micro_batches, samples[:1], self.forward.packed, self.forward.pad_id, self.parallel,
                                                  self.forward.share_prompts):
            values = token_values(self.model, batch.inputs, batch.targets["labels"], batch.token_rows, self.parallel.ulysses_group)
            store_token_values(values, micro_batch, batch, self.forward.packed, self.parallel, "values")

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """The critic's update toward the samples' `returns` (`run_update`), clipped around their old `values`."""
        return run_update(samples, self.update_settings, self.model, self.optimizer, self.scheduler, self.parallel, "critic",
                          lambda mini: value_backward(self.model, mini, self.micro_batching, self.forward, self.loss, self.parallel))
