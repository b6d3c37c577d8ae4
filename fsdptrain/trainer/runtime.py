"""Process-wide settings of a run: seeds, quiet non-main ranks, the CPU speed-ups, and memory readings."""

import ctypes
import logging
import random
import resource
import warnings

import numpy as np
import torch
import transformers
from torch import nn

from fsdptrain.config.shared import CpuSpeedupsConfig
from fsdptrain.distributed.gloo_comms import use_gloo_comms
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.models.loading import tied_embedding_grad_in_place

log = logging.getLogger("fsdptrain")
_announced: set[str] = set()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_non_main(parallel: Parallel) -> None:
    """Library warnings and logs appear once, from rank 0; the trainer's progress bar is the only one."""
    transformers.logging.disable_progress_bar()  # "Loading weights" bars, e.g. of a rollout engine's model
    if not parallel.is_main:
        warnings.filterwarnings("ignore")
        transformers.logging.set_verbosity_error()
        logging.getLogger().setLevel(logging.ERROR)


def announce_once(message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        log.info(message)


def keep_freed_host_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the kernel; False without glibc.

    Training on host memory frees and allocates the same large tensors every step (activations, gathered
    parameters, gradients). By default glibc serves each allocation over 32 MB with its own mmap, unmapped on
    free, and trims the heap's free top: every step then faults those pages in again. Freed memory is no longer
    returned, so the peak RSS grows a little (docs/performance.md has both figures).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
    mallopt(m_mmap_max, 0)  # every allocation from the heap, which a free leaves mapped
    mallopt(m_trim_threshold, 2**31 - 1)  # the heap's free top is given back only beyond 2 GiB
    return True


def apply_cpu_speedups(model: nn.Module, speedups: CpuSpeedupsConfig, parallel: Parallel, host_memory: bool, shard_ranks: int) -> None:
    """The CPU-only speed-ups (`trainer.cpu_speedups.*`) for a sharded model, each where its switch is on and it
    applies: the collectives and the embedding gradient on a CPU device, glibc's setting wherever the training
    tensors live in host memory (`host_memory`: a CPU device or CPU offload); `shard_ranks`: the ranks each of its
    shard groups spans."""
    if speedups.keep_freed_host_memory and host_memory and keep_freed_host_memory():
        announce_once("cpu speed-up on: glibc keeps freed memory for reuse (trainer.cpu_speedups.keep_freed_host_memory)")
    if parallel.device.type != "cpu":
        return
    if speedups.point_to_point_collectives:
        not_used = use_gloo_comms(model, shard_ranks)
        announce_once(
            f"cpu speed-up off: point-to-point collectives not used: {not_used}" if not_used
            else "cpu speed-up on: FSDP2 collectives as gloo send/recv (trainer.cpu_speedups.point_to_point_collectives)"
        )
    if speedups.tied_embedding_grad_in_place and tied_embedding_grad_in_place(model):
        announce_once("cpu speed-up on: tied embedding gradient added in place (trainer.cpu_speedups.tied_embedding_grad_in_place)")


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory, or on CPU the peak resident set size of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_held_gb(device: torch.device) -> float | None:
    """Accelerator memory allocated now (what the phases before this one left on it); None on CPU, whose figure
    would be the process's whole resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return None
