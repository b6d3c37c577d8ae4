"""Rollouts with transformers' `generate`, on every rank, from a plain (unsharded) copy of the policy that the
trainer refreshes after each update. Runs wherever transformers runs."""

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from fsdptrain.rl.rollout.base import Generation


def end_token_ids(model: PreTrainedModel, fallback: int) -> list[int]:
    eos = model.generation_config.eos_token_id
    return sorted(eos if isinstance(eos, list) else [eos] if eos is not None else [fallback])


def group_batches(prompts: Sequence[list[int]], n: int, batch_size: int) -> Iterator[tuple[Sequence[list[int]], int]]:
    """(prompts, copies of each) batches of at most `batch_size` sequences (or `n` where n > batch_size) in the order
    of n responses to each prompt in a row: whole groups together, so that each prompt is prefilled once."""
    per_batch, copies = max(1, batch_size // n), min(n, batch_size)
    for first in range(0, len(prompts), per_batch):
        for done in range(0, n, copies):
            yield prompts[first : first + per_batch], min(copies, n - done)


@torch.no_grad()
def generate(
    model: PreTrainedModel, prompts: Sequence[list[int]], n: int, max_new_tokens: int, batch_size: int, end_ids: list[int],
    pad_id: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, do_sample: bool = True,
    calculate_log_probs: bool = False,
) -> list[Generation]:
    """`n` responses to each prompt (n in a row), in left-padded batches. Each distinct prompt of a batch is
    prefilled once and its key/value cache copied to its responses: on a CPU, prefilling n copies of a prompt costs
    more than decoding the answers. The sampling log-probs need transformers to keep every step's (batch x vocab)
    scores, so they are computed only when asked."""
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=max(top_k, 0)) if do_sample else dict(do_sample=False)
    generations = []
    for distinct, copies in group_batches(prompts, n, batch_size):
        width = max(map(len, distinct))
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in distinct], device=model.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in distinct], device=model.device)
        cache = None
        if width > 1:  # all but the last prompt token; generate() runs that one and decodes from there
            positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            cache = model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], position_ids=positions[:, :-1],
                          use_cache=True, logits_to_keep=1).past_key_values
            cache.batch_repeat_interleave(copies)
        batch = [ids for ids in distinct for _ in range(copies)]
        output = model.generate(input_ids=input_ids.repeat_interleave(copies, 0), attention_mask=attention_mask.repeat_interleave(copies, 0),
                                past_key_values=cache, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=end_ids,
                                output_scores=calculate_log_probs, return_dict_in_generate=True, **sampling)
        tokens = output.sequences[:, width:]
        log_probs = None
        if calculate_log_probs:
            scores = torch.stack(output.scores, dim=1).float()  # (batch, steps, vocab), as processed for sampling
            log_probs = F.log_softmax(scores, dim=-1).gather(2, tokens[:, : scores.shape[1], None]).squeeze(2)
        for row, ids in enumerate(tokens.tolist()):
            end = next((i for i, token in enumerate(ids) if token in end_ids), None)
            kept = len(ids) if end is None else end + 1
            sampled = None if log_probs is None else log_probs[row, :kept].tolist()
            generations.append(Generation(batch[row], ids[:kept], [1] * kept, sampled, end is None))
    return generations


class HFRollout:
    """The policy's rollout engine: a plain copy of the model on this rank's device, in `dtype`."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype | str, pad_id: int, trust_remote_code: bool = False,
                 free_cache_engine: bool = True):
        # A CPU's fused attention kernel is slow for the one-token queries of decoding; plain matmuls beat it there
        attention = "eager" if device.type == "cpu" else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention, trust_remote_code=trust_remote_code)
        self.model.requires_grad_(False).eval().to(device)
        self.device, self.dtype, self.pad_id = device, self.model.dtype, pad_id
        self.group = None  # every rank runs its own copy
        self.end_ids = end_token_ids(self.model, pad_id)
        self.sleeps = free_cache_engine and device.type == "cuda"  # on CPU there is nothing to free
        self.parked: dict[str, torch.Tensor] | None = None  # pinned host buffers for the weights, made at the first sleep
        self.asleep = False

    def generate(self, prompts: Sequence[list[int]], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        return generate(self.model, prompts, n, max_new_tokens, batch_size, self.end_ids, self.pad_id, temperature, top_p, top_k, do_sample,
                        calculate_log_probs)

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parameters = dict(self.model.named_parameters())
        for name, tensor in weights:
            parameters[name].copy_(tensor)

    def shutdown(self) -> None:
        self.model = None  # the copy of the policy, freed before the job's teardown

    @torch.no_grad()
    def sleep(self) -> None:
        """Free the accelerator for training: the weights wait in pinned host buffers, made once and reused (a plain
        `.to("cpu")` allocates pageable memory at every sleep, which copies to and from the GPU more slowly)."""
        if not self.sleeps or self.asleep:
            return
        tensors = self._tensors()
        if self.parked is None:
            self.parked = {name: torch.empty_like(t, device="cpu", pin_memory=True) for name, t in tensors.items()}
        for name, t in tensors.items():
            self.parked[name].copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)
        for name, t in tensors.items():
            t.data = self.parked[name]
        torch.cuda.empty_cache()
        self.asleep = True

    @torch.no_grad()
    def wake_up(self) -> None:
        if not self.asleep:
            return
        for name, t in self._tensors().items():
            t.data = self.parked[name].to(self.device, non_blocking=True)
        self.asleep = False

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter (a tied one once) and buffer of the copy, by name."""
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
