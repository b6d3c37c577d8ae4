"""Rollout engines by name, built from one description, and the trainer's weights sent to them.

An engine is one file here that satisfies `base.RolloutEngine`, and one entry in ENGINES."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fsdptrain.models.lora import merged_weights
from fsdptrain.rl.rollout.base import RolloutEngine
from fsdptrain.rl.rollout.hf import HFRollout
from fsdptrain.rl.rollout.vllm import EngineSettings, VLLMRollout


@dataclass(frozen=True)
class EngineSpec:
    """What any engine is built from; `vllm` holds the settings only vLLM reads."""

    path: str
    dtype: torch.dtype
    device: torch.device
    pad_id: int
    trust_remote_code: bool
    max_model_len: int
    seed: int  # the same on every rank of one engine
    tensor_parallel_size: int
    free_cache_engine: bool  # sleep between rollouts where the platform can (CUDA), freeing the accelerator for training
    vllm: EngineSettings


ENGINES: dict[str, Callable[[EngineSpec], RolloutEngine]] = {
    "hf": lambda spec: HFRollout(spec.path, spec.device, spec.dtype, spec.pad_id, spec.trust_remote_code, spec.free_cache_engine),
    "vllm": lambda spec: VLLMRollout(spec.path, spec.dtype, spec.max_model_len, spec.seed, spec.vllm, distributed=True,
                                     trust_remote_code=spec.trust_remote_code, tensor_parallel_size=spec.tensor_parallel_size,
                                     free_cache_engine=spec.free_cache_engine),
}


def build_rollout(name: str, spec: EngineSpec) -> RolloutEngine:
    """The engine `name` (a key of ENGINES); its weights come from the trainer's first `sync_weights`."""
    return ENGINES[name](spec)


def engine_index(rank: int, tensor_parallel_size: int) -> int:
    """Which engine a rank belongs to: each group of `tensor_parallel_size` consecutive ranks shares one, so they
    must sample from one seed."""
    return rank // tensor_parallel_size


def sync_weights(model: nn.Module, engine: RolloutEngine, bucket_bytes: int) -> None:
    """The sharded model's full weights (a LoRA model's merged) into the engine, gathered `bucket_bytes` at a time
    in the engine's dtype."""
    engine.update_weights(merged_weights(model, engine.dtype, bucket_bytes=bucket_bytes))
