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


@pytest.mark.parametrize("batch_size", [1, 2, 4, 7])
def test_hf_engine_answers_as_plain_generate_whatever_the_batching(tiny_llama, batch_size):
    """Each prompt is prefilled once for its n responses, its cache copied to them, and groups are cut to fit the
    batch: the answers are those of transformers' generate on each prompt alone, unpadded, and their log-probs
    those of one forward pass over prompt and answer."""
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    prompts = [[5, 17, 42, 8, 9], [7], [11, 12, 13], [30, 31, 32, 33, 34, 35, 36]]
    generations = engine.generate(prompts, n=3, max_new_tokens=6, batch_size=batch_size, do_sample=False, calculate_log_probs=True)
    assert [g.prompt_ids for g in generations] == [p for p in prompts for _ in range(3)]
    for g in generations:
        alone = engine.model.generate(torch.tensor([g.prompt_ids]), max_new_tokens=6, do_sample=False, pad_token_id=2,
                                      eos_token_id=engine.end_ids)[0, len(g.prompt_ids):].tolist()
        end = next((i + 1 for i, t in enumerate(alone) if t in engine.end_ids), len(alone))
        assert g.response_ids == alone[:end], g.prompt_ids
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        logits = engine.model(ids).logits[0, len(g.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(g.prompt_ids) :, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(g.log_probs), expected, rtol=0, atol=1e-5)
