"""Rollout engines by name, built from one description, and the trainer's weights sent to them.

An engine is one file here that satisfies `base.RolloutEngine` and registers its builder in
`base.ROLLOUT_ENGINES`, plus its import below."""

from torch import nn

from fsdptrain.models.lora import merged_weights
from fsdptrain.rl.rollout import hf, vllm  # noqa: F401  (each registers its engine)
from fsdptrain.rl.rollout.base import ROLLOUT_ENGINES, EngineSpec, RolloutEngine


def build_rollout(name: str, spec: EngineSpec) -> RolloutEngine:
    """The engine `name` (registered in ROLLOUT_ENGINES); its weights come from the trainer's first `sync_weights`."""
    return ROLLOUT_ENGINES[name](spec)


def engine_index(rank: int, tensor_parallel_size: int) -> int:
    """Which engine a rank belongs to: each group of `tensor_parallel_size` consecutive ranks shares one, so they
    must sample from one seed."""
    return rank // tensor_parallel_size


def sync_weights(model: nn.Module, engine: RolloutEngine, bucket_bytes: int) -> None:
    """The sharded model's full weights (a LoRA model's merged) into the engine, gathered `bucket_bytes` at a time
    in the engine's dtype."""
    engine.update_weights(merged_weights(model, engine.dtype, bucket_bytes=bucket_bytes))
