"""The engine both trainers share: start-up, micro-batch planning, token-weighted backward, metrics."""

import ctypes
import logging
import random
import resource
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers

from fsdptrain.config.schema import DataConfig
from fsdptrain.data.batching import collate_packed, collate_padded, min_token_micro_batches, split_by_count, split_by_tokens
from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.ulysses import shard_sequence
from fsdptrain.models.attention import cu_seqlens_from_position_ids, max_seqlen


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_non_main(parallel: Parallel) -> None:
    """Library warnings and logs appear once, from rank 0."""
    if not parallel.is_main:
        warnings.filterwarnings("ignore")
        transformers.logging.set_verbosity_error()
        logging.getLogger().setLevel(logging.ERROR)


def keep_freed_host_memory() -> None:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    Training on host memory frees and allocates the same large tensors every step (activations, gathered
    parameters, gradients). By default glibc serves each allocation over 32 MB with its own mmap, unmapped on
    free, and trims the heap's free top: every step then faults those pages in again. On this project's CPU VM
    that was 180-360k page faults a step per rank for SmolLM2. Freed memory is no longer returned, so the peak
    RSS grows a little (docs/performance.md). Without glibc (no `mallopt`) nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    mallopt(m_mmap_max, 0)  # every allocation from the heap, which a free leaves mapped
    mallopt(m_trim_threshold, 2**31 - 1)  # the heap's free top is given back only beyond 2 GiB


def plan_micro_batches(samples: Sequence[Sample], data: DataConfig, parallel: Parallel) -> list[list[Sample] | None]:
    """This rank's micro-batches; every rank gets the same count, padded with None where it has fewer.

    FSDP needs the same number of forward passes on every rank, so the count is agreed across the world.
    """
    if not samples:
        local: list[list[Sample]] = []
    elif data.use_dynamic_bsz:
        lengths = [len(s) for s in samples]
        parts = torch.tensor(min_token_micro_batches(lengths, data.max_token_len_per_gpu))
        dist.all_reduce(parts, op=dist.ReduceOp.MAX)
        local = split_by_tokens(samples, min(int(parts), len(samples)))
    else:
        local = split_by_count(samples, data.micro_batch_size_per_gpu)
    count = torch.tensor(len(local))
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return local + [None] * (int(count) - len(local))


def collate(micro_batch: Sequence[Sample], packed: bool, pad_token_id: int, parallel: Parallel) -> dict[str, Any]:
    """The model inputs of a micro-batch on this rank's device: with sequence parallelism, its slice of the row."""
    if not packed:
        batch = collate_padded(micro_batch, pad_token_id)
        return {k: v.to(parallel.device, non_blocking=True) for k, v in batch.items()}
    batch = collate_packed(micro_batch, pad_to_multiple=parallel.sp_size)
    cu_seqlens = cu_seqlens_from_position_ids(batch["position_ids"])  # of the whole row, before sharding
    if parallel.sp_size > 1:
        batch = shard_sequence(batch, parallel.sp_rank, parallel.sp_size)
    batch = {k: v.to(parallel.device, non_blocking=True) for k, v in batch.items()}
    # Sequence boundaries for the packed attention, found here on the host rather than in every layer on the device.
    batch["cu_seq_lens_q"] = cu_seqlens.to(parallel.device, non_blocking=True)
    batch["max_length_q"] = max_seqlen(cu_seqlens)
    return batch


def loss_tokens(micro_batch: Sequence[Sample] | None) -> int:
    """Training targets in a micro-batch: loss-mask positions that have a previous token to predict them."""
    return sum(int(s.loss_mask[1:].sum()) for s in micro_batch or [])


def once_per_sp_group(counts: Sequence[float], parallel: Parallel) -> list[float]:
    """Counts of samples every SP rank holds whole, kept on one rank of the group so that a world sum counts
    them once (losses are summed over sequence slices and need no such care)."""
    return [c if parallel.sp_rank == 0 else 0 for c in counts]


def all_reduce_sum(values: Sequence[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def dp_all_reduce_sum(value: float, parallel: Parallel) -> float:
    """Sum over data-parallel ranks (each SP group counted once)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=parallel.device)
    dist.all_reduce(tensor, group=parallel.mesh.get_group("dp"))
    return float(tensor)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or on CPU the peak resident set size of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)
