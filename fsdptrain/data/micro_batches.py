"""One rank's forward passes: how its samples are cut into micro-batches, and each collated for the model.

A micro-batch carries the model's inputs and the loss's inputs apart: `inputs` goes to the model as keyword
arguments, `targets` (the labels and any per-token loss inputs of the samples, shifted to the position that
predicts their token) goes to the loss only.

A packed row can hold a shared prompt once: the responses of an RL group all begin with the same prompt, so with
`share_prefixes` consecutive samples with the same `shared_prefix` tokens put only their responses in the row,
each attending to the first sample's prompt. The forward and backward then cost the prompt once per group, not
once per response, and the result is the same (the prompt's gradient is the sum over its responses either way).
The targets keep the unshared layout (every sample's positions, in order) and `token_rows` maps each of them
to the row position whose hidden state predicts it.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdptrain.config.base import positive
from fsdptrain.data.batching import min_token_micro_batches, split_by_count, split_by_tokens
from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.ulysses import shard_sequence
from fsdptrain.errors import ConfigError
from fsdptrain.models.loss import IGNORE_INDEX
from fsdptrain.models.vision import IMAGE_INPUTS


@dataclass(frozen=True)
class MicroBatching:
    """How one rank's share of a batch is cut into forward passes, with the keys it came from (SFT and GRPO
    name them differently) so that errors name the user's key."""

    size: int
    dynamic: bool
    max_tokens: int | None
    size_key: str
    dynamic_key: str
    max_tokens_key: str


def validate_micro_batching(batching: MicroBatching, max_length: int, max_length_key: str) -> None:
    positive(batching.size_key, batching.size)
    if batching.dynamic:
        if batching.max_tokens is None:
            raise ConfigError(f"{batching.max_tokens_key} is required when {batching.dynamic_key}=true")
        if batching.max_tokens < max_length:
            raise ConfigError(
                f"{batching.max_tokens_key} ({batching.max_tokens}) must be >= {max_length_key} ({max_length}) "
                "so that every sample fits one micro-batch"
            )


def check_batch_layout(batch_size: int, batch_size_key: str, batching: MicroBatching, dp_size: int) -> None:
    """Sizes that depend on the number of data-parallel ranks, checked once the world is known."""
    if batch_size % dp_size:
        raise ConfigError(f"{batch_size_key} ({batch_size}) must be divisible by the data-parallel size ({dp_size})")
    per_rank = batch_size // dp_size
    if not batching.dynamic and per_rank % batching.size:
        raise ConfigError(
            f"{batch_size_key} / dp = {batch_size} / {dp_size} = {per_rank} samples per rank "
            f"must be divisible by {batching.size_key} ({batching.size})"
        )


@dataclass
class MicroBatch:
    inputs: dict[str, Any]  # model keyword arguments: input_ids, position_ids, and attention_mask or packed boundaries
    targets: dict[str, torch.Tensor]  # "labels" and the samples' token_values, each sample's positions in order
    token_rows: torch.Tensor | None = None  # the row position of each target position where prompts are shared


def plan_micro_batches(samples: Sequence[Sample], batching: MicroBatching, parallel: Parallel) -> list[list[Sample] | None]:
    """This rank's micro-batches; every rank gets the same count, padded with None where it has fewer.

    FSDP needs the same number of forward passes on every rank, so the count is agreed across the world.
    """
    local: list[list[Sample]] = []
    if batching.dynamic:  # every rank joins the agreement on the part count, one without samples too
        parts = torch.tensor(min_token_micro_batches([len(s) for s in samples], batching.max_tokens) if samples else 0)
        dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=parallel.group)
        if samples:
            local = split_by_tokens(samples, min(int(parts), len(samples)))
    elif samples:
        local = split_by_count(samples, batching.size)
    count = torch.tensor(len(local))
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel.group)
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
        targets[name] = torch.cat([values[1:], values.new_zeros((1, *values.shape[1:]))])
    return targets


SharedPrompt = tuple[torch.Tensor, dict[str, torch.Tensor] | None]  # a prompt's ids and its images' inputs


def shareable_prefix(sample: Sample) -> SharedPrompt | None:
    """The prompt (ids and images) a packed row may hold once for the samples after this one, or None."""
    return (sample.input_ids[: sample.shared_prefix], sample.images) if sample.shared_prefix else None


def shares_prompt(sample: Sample, prompt: SharedPrompt | None) -> bool:
    """Whether `sample` begins with `prompt` (an earlier sample's shareable prefix) and has tokens after it: a
    packed row that holds the prompt already holds only the rest of it. The images count as much as the ids: two
    groups asking the same question of different images (the same text, the same count of image tokens) are two
    prompts."""
    p = sample.shared_prefix
    if prompt is None or not 0 < p < len(sample):
        return False
    ids, images = prompt
    return torch.equal(sample.input_ids[:p], ids) and same_images(sample.images, images)


def same_images(first: dict[str, torch.Tensor] | None, second: dict[str, torch.Tensor] | None) -> bool:
    if first is second:  # a group's samples hold one images dict
        return True
    if first is None or second is None:
        return False
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def collate_packed(samples: Sequence[Sample], pad_to_multiple: int = 1, share_prefixes: bool = False) -> MicroBatch:
    """One row of concatenated samples; position_ids restart at 0 at each sample start, and the sequence
    boundaries come as transformers' `cu_seq_lens_q` / `max_length_q`.

    With `pad_to_multiple` > 1 the row is padded at the end by a segment whose labels are ignored. With
    `share_prefixes`, a prompt shared by consecutive samples is in the row once (see the module's docstring).
    """
    pieces, positions, token_rows, query_lengths, key_lengths = [], [], [], [], []
    row_length, prompt_start, prompt = 0, 0, None  # the row start and ids of the last shareable prefix in the row
    for sample in samples:
        p = sample.shared_prefix
        if share_prefixes and shares_prompt(sample, prompt):
            piece, rows = sample.input_ids[p:], torch.cat([prompt_start + torch.arange(p), row_length + torch.arange(len(sample) - p)])
            positions.append(torch.arange(p, len(sample)))
        else:
            piece, rows = sample.input_ids, row_length + torch.arange(len(sample))
            positions.append(torch.arange(len(sample)))
            prompt_start, prompt = row_length, shareable_prefix(sample)
        pieces.append(piece)
        token_rows.append(rows)
        query_lengths.append(len(piece))
        key_lengths.append(len(rows))
        row_length += len(piece)
    pad = -row_length % pad_to_multiple
    if pad:
        pieces.append(torch.zeros(pad, dtype=torch.long))
        positions.append(torch.arange(pad))
        token_rows.append(row_length + torch.arange(pad))
        query_lengths.append(pad)
        key_lengths.append(pad)
    shifted = [_shifted(s) for s in samples]
    targets = {}
    for name in shifted[0]:
        padding = torch.full((pad,), IGNORE_INDEX) if name == "labels" else shifted[0][name].new_zeros((pad, *shifted[0][name].shape[1:]))
        targets[name] = torch.cat([t[name] for t in shifted] + [padding])[None]
    inputs = {"input_ids": torch.cat(pieces)[None], "position_ids": torch.cat(positions)[None],
              "cu_seq_lens_q": _cumulative(query_lengths), "max_length_q": max(query_lengths)}
    if any(s.positions is not None for s in samples):
        inputs.update(packed_image_inputs(samples, share_prefixes, pad))
    if query_lengths == key_lengths:
        return MicroBatch(inputs, targets)
    rows = torch.cat(token_rows)
    inputs.update(cu_seq_lens_k=_cumulative(key_lengths), max_length_k=max(key_lengths), key_rows=rows)
    return MicroBatch(inputs, targets, token_rows=rows)


def packed_image_inputs(samples: Sequence[Sample], share_prefixes: bool, pad: int) -> dict[str, torch.Tensor]:
    """A vision-language model's packed row: (3, 1, T) rotary positions, each sample's own (its part in the row), and
    its images' patches in row order. A sample that shares the prompt before it holds its images there (an RL
    group's images are its prompt's): they are in the row once."""
    positions, images, prompt = [], [], None
    for sample in samples:
        own = rotary_positions(sample)
        if share_prefixes and shares_prompt(sample, prompt):
            positions.append(own[:, sample.shared_prefix :])
            continue
        positions.append(own)
        prompt = shareable_prefix(sample)
        if sample.images is not None:
            images.append(sample.images)
    positions.append(torch.arange(pad).expand(3, -1))
    return {"position_ids": torch.cat(positions, dim=1)[:, None], **joined(images)}


def padded_image_inputs(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    """A vision-language model's padded batch: (3, batch, width) rotary positions and the images in row order."""
    positions = torch.zeros(3, len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        positions[:, row, : len(sample)] = rotary_positions(sample)
    return {"position_ids": positions, **joined([s.images for s in samples if s.images is not None])}


def rotary_positions(sample: Sample) -> torch.Tensor:
    """A sample's (3, length) positions: its own, or a text sample's plain ones on all three axes."""
    return sample.positions if sample.positions is not None else torch.arange(len(sample)).expand(3, -1)


def joined(images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several samples' image inputs as one forward takes them, in order (none without images)."""
    return {name: torch.cat([image[name] for image in images]) for name in IMAGE_INPUTS} if images else {}


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


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
        name: torch.full(shape, IGNORE_INDEX) if name == "labels" else values.new_zeros((*shape, *values.shape[1:]))
        for name, values in shifted[0].items()
    }
    for row, (sample, sample_targets) in enumerate(zip(samples, shifted)):
        n = len(sample)
        inputs["input_ids"][row, :n] = sample.input_ids
        inputs["attention_mask"][row, :n] = 1
        inputs["position_ids"][row, :n] = torch.arange(n)
        for name, values in sample_targets.items():
            targets[name][row, :n] = values
    if any(s.positions is not None for s in samples):
        inputs.update(padded_image_inputs(samples, width))
    return MicroBatch(inputs, targets)


def _to(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def collate(micro_batch: Sequence[Sample], packed: bool, pad_token_id: int, parallel: Parallel, share_prefixes: bool = False) -> MicroBatch:
    """A micro-batch on this rank's device: with sequence parallelism, its slice of the packed row's targets and of
    the row itself (a vision-language model's row whole, see below; prompts are shared only without it: a slice's
    targets would need hidden states from other slices)."""
    if not packed:
        batch = collate_padded(micro_batch, pad_token_id)
        return MicroBatch(_to(batch.inputs, parallel.device), _to(batch.targets, parallel.device))
    batch = collate_packed(micro_batch, pad_to_multiple=parallel.sp_size, share_prefixes=share_prefixes and parallel.sp_size == 1)
    # The boundaries (of the whole row) stay whole; they are found here on the host rather than in every layer.
    boundaries = {k: v for k, v in batch.inputs.items() if k not in ("input_ids", "position_ids")}
    row = {"input_ids": batch.inputs["input_ids"], "position_ids": batch.inputs["position_ids"]}
    targets = batch.targets
    if parallel.sp_size > 1:
        targets = shard_sequence(targets, parallel.sp_rank, parallel.sp_size)
        # a vision-language model's row (3-D positions) goes whole: its images join the embeddings by their places in
        # the whole row, and its decoder then keeps this rank's share (models/vision.py)
        if row["position_ids"].dim() == 2:
            row = shard_sequence(row, parallel.sp_rank, parallel.sp_size)
    inputs = {**_to(row, parallel.device),
              **{k: v.to(parallel.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in boundaries.items()}}
    token_rows = None if batch.token_rows is None else batch.token_rows.to(parallel.device, non_blocking=True)
    return MicroBatch(inputs, _to(targets, parallel.device), token_rows)


def forward_batches(micro_batches: Sequence[list[Sample] | None], fallback: Sequence[Sample], packed: bool, pad_token_id: int, parallel: Parallel,
                    share_prefixes: bool = False) -> Iterator[tuple[list[Sample] | None, MicroBatch]]:
    """Each planned micro-batch with its collated batch. Where this rank has fewer micro-batches than another
    (None), `fallback` is collated instead: FSDP needs the same forward passes on every rank, so the rank runs one
    whose result the caller discards (it sees the None)."""
    for micro_batch in micro_batches:
        yield micro_batch, collate(micro_batch or fallback, packed, pad_token_id, parallel, share_prefixes)
