"""Both rollout engines, and an engine in a process of its own, satisfy the one contract (rl/rollout/base.py), method
for method and argument for argument, so that the trainer, evaluation and a multi-turn loop can drive any."""

import inspect

import pytest
import torch

from fsdptrain.rl.rollout import ROLLOUT_ENGINES
from fsdptrain.rl.rollout.base import RolloutEngine
from fsdptrain.rl.rollout.engine_process import EngineProcess
from fsdptrain.rl.rollout.hf import HFRollout
from fsdptrain.rl.rollout.vllm import VLLMRollout

METHODS = ("generate", "update_weights", "sleep", "wake_up", "shutdown")


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("engine, takes_images", [(HFRollout, True), (VLLMRollout, False), (EngineProcess, False)])
def test_every_method_takes_the_contracts_arguments(engine, takes_images):
    """The contract's arguments; `images` besides them where the engine declares that it takes them."""
    for method in METHODS:
        extra = [("images", inspect.Parameter.KEYWORD_ONLY, None)] if method == "generate" and takes_images else []
        assert parameters(getattr(engine, method)) == parameters(getattr(RolloutEngine, method)) + extra, f"{engine.__name__}.{method}"
    assert ROLLOUT_ENGINES.names(images=True) == ("hf",)


def test_every_named_engine_is_built():
    assert set(ROLLOUT_ENGINES) == {"hf", "vllm"}


def test_a_built_engine_is_a_rollout_engine(tiny_llama):
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    assert isinstance(engine, RolloutEngine) and engine.dtype == torch.float32
    (generation,) = engine.generate([[5, 17, 42]], n=1, max_new_tokens=4, batch_size=1, do_sample=False)
    assert generation.prompt_ids == [5, 17, 42] and len(generation.response_ids) == len(generation.response_mask) <= 4


def assert_plain_greedy_answers(engine: HFRollout, generations: list, max_new_tokens: int) -> None:
    """Each greedy answer is transformers' generate on its prompt alone, unpadded, through its first end token, and
    its log-probs those of one forward pass over prompt and answer."""
    for g in generations:
        alone = engine.model.generate(torch.tensor([g.prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2,
                                      eos_token_id=engine.end_ids)[0, len(g.prompt_ids):].tolist()
        end = next((i + 1 for i, t in enumerate(alone) if t in engine.end_ids), len(alone))
        assert g.response_ids == alone[:end], g.prompt_ids
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        logits = engine.model(ids).logits[0, len(g.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(g.prompt_ids) :, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(g.log_probs), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2, 4, 7])
def test_hf_engine_answers_as_plain_generate_whatever_the_batching(tiny_llama, batch_size):
    """Each prompt is prefilled once for its n responses, its cache copied to them, and groups are cut to fit the
    batch: the answers are those of transformers' generate on each prompt alone, unpadded, and their log-probs
    those of one forward pass over prompt and answer."""
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    prompts = [[5, 17, 42, 8, 9], [7], [11, 12, 13], [30, 31, 32, 33, 34, 35, 36]]
    generations = engine.generate(prompts, n=3, max_new_tokens=6, batch_size=batch_size, do_sample=False, calculate_log_probs=True)
    assert [g.prompt_ids for g in generations] == [p for p in prompts for _ in range(3)]
    assert_plain_greedy_answers(engine, generations, max_new_tokens=6)


def test_hf_engine_prefills_a_batchs_common_prefix_once(tiny_llama):
    """Prompts that begin alike (a chat template's opening, a shared instruction), one of them the prefix and a
    token: the prefix is forwarded once, and the answers are still plain generate's on each prompt alone, with the
    log-probs of one forward over prompt and answer; with enable_prefix_caching=false every prompt is whole."""
    prefix = [5, 17, 42, 8, 9, 23, 61]
    prompts = [prefix + [7], prefix + [11, 12, 13], prefix + [30, 31, 32, 33, 34, 35, 36], prefix[:3] + [9, 9]]
    for caching, batch, first_forward in ((True, prompts[:3], 7), (True, prompts, 3), (False, prompts[:3], 3 * 14)):
        engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2, enable_prefix_caching=caching)
        forwarded = []
        engine.model.get_input_embeddings().register_forward_pre_hook(lambda module, args, seen=forwarded: seen.append(args[0].numel()))
        generations = engine.generate(batch, n=2, max_new_tokens=6, batch_size=8, do_sample=False, calculate_log_probs=True)
        assert forwarded[0] == first_forward, (caching, len(batch), forwarded[:2])
        assert_plain_greedy_answers(engine, generations, max_new_tokens=6)


def test_hf_engine_batches_prompts_of_a_length_together(tiny_llama):
    """Prompts that fill several batches are batched shortest first, so that a batch pads little: here two batches
    of lengths (1, 2) and (6, 7) prefill 4 + 14 positions, where the prompts' own order would pad to 14 + 12; the
    answers come back in the prompts' order and are plain generate's on each prompt alone."""
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    prompts = [[30, 31, 32, 33, 34, 35, 36], [7], [5, 17, 42, 8, 9, 23], [11, 12]]
    forwarded = []
    engine.model.get_input_embeddings().register_forward_pre_hook(lambda module, args: forwarded.append(tuple(args[0].shape)))
    generations = engine.generate(prompts, n=1, max_new_tokens=6, batch_size=2, do_sample=False, calculate_log_probs=True)
    prefills = [shape for shape in forwarded if shape[1] > 1]
    assert prefills == [(2, 2), (2, 7)], forwarded
    assert [g.prompt_ids for g in generations] == prompts
    assert_plain_greedy_answers(engine, generations, max_new_tokens=6)


def test_hf_engine_rows_that_end_early_leave_the_others_right(tiny_llama):
    """End tokens taken from sampled answers, so that the rows of a batch end at different steps and the rows
    still going are forwarded alone: each answer's log-probs are still those of one forward pass over its own
    prompt and answer (a row given another's cache entries would not be), and it stops at its first end token."""
    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    prompts = [[5, 17, 42, 8, 9], [7], [11, 12, 13], [30, 31, 32, 33, 34, 35, 36]]
    torch.manual_seed(0)
    first = engine.generate(prompts, n=2, max_new_tokens=8, batch_size=8, temperature=2.0)
    engine.end_ids = [first[0].response_ids[1], first[3].response_ids[4]]
    torch.manual_seed(0)  # the same draws until the first row ends (at its second token), fewer from there
    generations = engine.generate(prompts, n=2, max_new_tokens=8, batch_size=8, temperature=2.0, calculate_log_probs=True)
    assert [g.prompt_ids for g in generations] == [p for p in prompts for _ in range(2)]
    for g in generations:
        ends = [i for i, t in enumerate(g.response_ids) if t in engine.end_ids]
        assert (ends, len(g.response_ids)) == (([], 8) if g.truncated else ([len(g.response_ids) - 1], len(g.response_ids)))
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        logits = engine.model(ids).logits[0, len(g.prompt_ids) - 1 : -1] / 2.0
        expected = torch.log_softmax(logits, -1).gather(1, ids[0, len(g.prompt_ids) :, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(g.log_probs), expected, rtol=1e-5, atol=1e-5)
    assert len(generations[0].response_ids) == 2 and any(g.truncated for g in generations)  # the batch did shrink


def test_sampling_draws_each_token_at_its_probability():
    """The engine's draw (an inverted cumulative distribution, not torch.multinomial) against the softmax it samples:
    frequencies within 5 standard errors over 40000 draws, masked tokens never drawn, and the log-probs exact."""
    from fsdptrain.rl.rollout.hf import draw

    torch.manual_seed(0)
    scores = torch.tensor([[2.0, 0.5, float("-inf"), -1.0, 1.0, float("-inf")]]).repeat(40000, 1)
    tokens, log_probs = draw(scores, do_sample=True)
    probs = torch.softmax(scores[0], -1)
    frequency = torch.bincount(tokens, minlength=6).double() / len(tokens)
    error = (probs.double() * (1 - probs.double()) / len(tokens)).sqrt()
    assert ((frequency - probs.double()).abs() <= 5 * error).all(), (frequency, probs)
    assert frequency[2] == 0 and frequency[5] == 0
    torch.testing.assert_close(log_probs, torch.log_softmax(scores, -1).gather(1, tokens[:, None]).squeeze(1))
    greedy, greedy_log_probs = draw(scores[:2], do_sample=False)
    assert greedy.tolist() == [0, 0] and torch.allclose(greedy_log_probs, probs[0].log())


@pytest.mark.parametrize("top_k, top_p", [(2, 1.0), (-1, 0.6), (3, 0.9)])
def test_hf_engine_samples_only_what_top_k_and_top_p_keep(tiny_llama, top_k, top_p):
    """Sampled answers use only the tokens that transformers' top-k and top-p processors keep at each step, and
    their log-probs are those of the distribution left: the renormalized softmax over the kept tokens."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    engine = HFRollout(tiny_llama, torch.device("cpu"), torch.float32, pad_id=2)
    torch.manual_seed(0)
    generations = engine.generate([[5, 17, 42], [7, 8, 9, 10]], n=8, max_new_tokens=5, batch_size=16, temperature=1.5, top_k=top_k,
                                  top_p=top_p, calculate_log_probs=True)
    for g in generations:
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        scores = engine.model(ids).logits[0, len(g.prompt_ids) - 1 : -1] / 1.5
        if top_k > 0:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        expected = torch.log_softmax(scores, -1).gather(1, torch.tensor(g.response_ids)[:, None]).squeeze(1)
        assert torch.isfinite(expected).all(), "a token outside the kept set was sampled"
        torch.testing.assert_close(torch.tensor(g.log_probs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_grouped_attention_gives_eagers_logits_on_a_padded_batch_with_a_cache(tiny_llama, tiny_qwen2, arch):
    """The engine's CPU attention (KV heads shared by their query heads, not repeated) against transformers' own
    eager attention, GQA 4:2: the same logits for a left-padded prefill and for a decoding step from its cache."""
    from transformers import AutoModelForCausalLM

    from fsdptrain.models.attention import GROUPED_ATTENTION

    path = {"llama": tiny_llama, "qwen2": tiny_qwen2}[arch]
    logits = []
    for attention in (GROUPED_ATTENTION, "eager"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()
        assert model.config.num_key_value_heads < model.config.num_attention_heads
        input_ids = torch.tensor([[2, 2, 2, 5, 17, 42], [11, 12, 13, 14, 15, 16]])
        attention_mask = (input_ids != 2).long()
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            prefill = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
            step = model(input_ids=torch.tensor([[7], [8]]), attention_mask=torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1),
                         position_ids=positions[:, -1:] + 1, past_key_values=prefill.past_key_values, use_cache=True)
        logits.append((prefill.logits[attention_mask.bool()], step.logits))
    for grouped, eager in zip(*logits):
        torch.testing.assert_close(grouped, eager, rtol=1e-5, atol=1e-5)
