"""One rank's forward passes: how its samples are cut into micro-batches, and each collated for the model.

A micro-batch carries the model's inputs and the loss's inputs apart: `inputs` goes to the model as keyword
arguments, `targets` (the labels and any per-token loss inputs of the samples, shifted to the position that
predicts their token) goes to the loss only.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdptrain.config.schema import MicroBatching
from fsdptrain.data.batching import min_token_micro_batches, split_by_count, split_by_tokens
from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.ulysses import shard_sequence
from fsdptrain.models.attention import cu_seqlens_from_position_ids, max_seqlen
from fsdptrain.models.loss import IGNORE_INDEX


@dataclass
class MicroBatch:
    inputs: dict[str, Any]  # model keyword arguments: input_ids, position_ids, and attention_mask or packed boundaries
    targets: dict[str, torch.Tensor]  # "labels" and the samples' token_values, aligned with input_ids


def plan_micro_batches(samples: Sequence[Sample], batching: MicroBatching, parallel: Parallel) -> list[list[Sample] | None]:
    """This rank's micro-batches; every rank gets the same count, padded with None where it has fewer.

    FSDP needs the same number of forward passes on every rank, so the count is agreed across the world.
    """
    if not samples:
        local: list[list[Sample]] = []
    elif batching.dynamic:
        lengths = [len(s) for s in samples]
        parts = torch.tensor(min_token_micro_batches(lengths, batching.max_tokens))
        dist.all_reduce(parts, op=dist.ReduceOp.MAX)
        local = split_by_tokens(samples, min(int(parts), len(samples)))
    else:
        local = split_by_count(samples, batching.size)
    count = torch.tensor(len(local))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return local + [None] * (int(count) - len(local))


def loss_tokens(micro_batch: Sequence[Sample] | None) -> int:
    """Training targets in a micro-batch: loss-mask positions that have a previous token to predict them."""
    return sum(int(s.loss_mask[1:].sum()) for s in micro_batch or [])


def _shifted(sample: Sample) -> dict[str, torch.Tensor]:
    """Next-token targets: position t predicts token t+1 where that token is a loss token; the token values of
    t+1 move to t with it (0 at the last position)."""
    labels = torch.full_like(sample.input_ids, IGNORE_INDEX)
    labels[:-1] = torch.where(sample.loss_mask[1:].bool(), sample.input_ids[1:], IGNORE_INDEX)
    targets = {"labels": labels}
    for name, values in sample.token_values.items():
        targets[name] = torch.cat([values[1:], values.new_zeros(1)])
    return targets


def collate_packed(samples: Sequence[Sample], pad_to_multiple: int = 1) -> MicroBatch:
    """One row of concatenated samples; position_ids restart at 0 at each sample start.

    With `pad_to_multiple` > 1 the row is padded at the end by a segment whose labels are ignored.
    """
    total = sum(len(s) for s in samples)
    pad = -total % pad_to_multiple
    ids = [s.input_ids for s in samples] + [torch.zeros(pad, dtype=torch.long)]
    positions = [torch.arange(len(s)) for s in samples] + [torch.arange(pad)]
    shifted = [_shifted(s) for s in samples]
    targets = {}
    for name in shifted[0]:
        padding = torch.full((pad,), IGNORE_INDEX) if name == "labels" else shifted[0][name].new_zeros(pad)
        targets[name] = torch.cat([t[name] for t in shifted] + [padding])[None]
    return MicroBatch({"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None]}, targets)


def collate_padded(samples: Sequence[Sample], pad_token_id: int) -> MicroBatch:
    """A (batch, longest) batch padded on the right, with its attention mask."""
    width = max(len(s) for s in samples)
    shape = (len(samples), width)
    inputs = {
        "input_ids": torch.full(shape, pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(shape, dtype=torch.long),
        "position_ids": torch.zeros(shape, dtype=torch.long),
    }
    shifted = [_shifted(s) for s in samples]
    targets = {
        name: torch.full(shape, IGNORE_INDEX) if name == "labels" else shifted[0][name].new_zeros(shape) for name in shifted[0]
    }
    for row, (sample, sample_targets) in enumerate(zip(samples, shifted)):
        n = len(sample)
        inputs["input_ids"][row, :n] = sample.input_ids
        inputs["attention_mask"][row, :n] = 1
        inputs["position_ids"][row, :n] = torch.arange(n)
        for name, values in sample_targets.items():
            targets[name][row, :n] = values
    return MicroBatch(inputs, targets)


def _to(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def collate(micro_batch: Sequence[Sample], packed: bool, pad_token_id: int, parallel: Parallel) -> MicroBatch:
    """A micro-batch on this rank's device: with sequence parallelism, its slice of the packed row."""
    if not packed:
        batch = collate_padded(micro_batch, pad_token_id)
        return MicroBatch(_to(batch.inputs, parallel.device), _to(batch.targets, parallel.device))
    batch = collate_packed(micro_batch, pad_to_multiple=parallel.sp_size)
    cu_seqlens = cu_seqlens_from_position_ids(batch.inputs["position_ids"])  # of the whole row, before sharding
    inputs, targets = batch.inputs, batch.targets
    if parallel.sp_size > 1:
        inputs, targets = (shard_sequence(t, parallel.sp_rank, parallel.sp_size) for t in (inputs, targets))
    inputs = _to(inputs, parallel.device)
    # Sequence boundaries for the packed attention, found here on the host rather than in every layer on the device.
    inputs["cu_seq_lens_q"] = cu_seqlens.to(parallel.device, non_blocking=True)
    inputs["max_length_q"] = max_seqlen(cu_seqlens)
    return MicroBatch(inputs, _to(targets, parallel.device))
