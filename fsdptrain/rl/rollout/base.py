"""The contract every rollout engine satisfies (hf.py, vllm.py), and what it returns.

A multi-turn agent loop drives the same call turn by turn: each live trajectory's token ids so far (its prompt,
earlier turns, tool or environment output) as one prompt with n=1, every trajectory of a batch in one call; it
appends the turn's generated tokens with response mask 1 and the tokens it renders itself (tool results) with 0,
so that a trajectory is one Generation whatever the number of turns.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Generation:
    prompt_ids: list[int]
    response_ids: list[int]  # through the first end-of-turn token, or max_new_tokens of them
    response_mask: list[int]  # 1 on tokens the policy produced (a multi-turn rollout gives tool output 0)
    log_probs: list[float] | None  # with calculate_log_probs, the sampling log-probs: after temperature, top-k and top-p
    truncated: bool  # stopped by max_new_tokens before an end token

    @property
    def mask(self) -> torch.Tensor:
        """response_mask as float weights for per-token sums over the response."""
        return torch.tensor(self.response_mask, dtype=torch.float32)


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples from the policy's weights, which the trainer sends after every update."""

    dtype: torch.dtype  # the dtype `update_weights` expects its tensors in

    def generate(self, prompts: Sequence[list[int]], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        """`n` responses to each prompt, n in a row; `batch_size` sequences a forward where the engine batches by
        count; with `calculate_log_probs` each response's sampling log-probs. With tensor parallelism every rank
        of the engine calls it, each with its own prompts (or none)."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load each (name, full tensor) as it arrives; names are the Hugging Face model's own."""
        ...

    def sleep(self) -> None:
        """Free the accelerator memory the engine holds between rollouts (where it can)."""
        ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None:
        """Release the engine; called once, after the job's last collective."""
        ...
