"""Both rollout engines satisfy the one contract (rl/rollout/base.py), method for method and argument for
argument, so that the trainer, evaluation and a multi-turn loop can drive either."""

import inspect

import pytest
import torch

from fsdptrain.rl.rollout import ENGINES
from fsdptrain.rl.rollout.base import RolloutEngine
from fsdptrain.rl.rollout.hf import HFRollout
from fsdptrain.rl.rollout.vllm import VLLMRollout

METHODS = ("generate", "update_weights", "sleep", "wake_up", "shutdown")


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("engine", [HFRollout, VLLMRollout])
def test_every_method_takes_the_contracts_arguments(engine):
    for method in METHODS:
        assert parameters(getattr(engine, method)) == parameters(getattr(RolloutEngine, method)), f"{engine.__name__}.{method}"


def test_every_named_engine_is_built():
    assert set(ENGINES) == {"hf", "vllm"}


def test_a_built_engine_is_a_rollout_engine(tiny_llama):
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    assert isinstance(engine, RolloutEngine) and engine.dtype == torch.float32
    (generation,) = engine.generate([[5, 17, 42]], n=1, max_new_tokens=4, batch_size=1, do_sample=False)
    assert generation.prompt_ids == [5, 17, 42] and len(generation.response_ids) == len(generation.response_mask) <= 4
