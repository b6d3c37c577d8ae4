"""The contract every rollout engine satisfies (hf.py, vllm.py), and what it returns.

A multi-turn agent loop (rl/agent/loop.py) drives the same call turn by turn: each live trajectory's token ids so
far (its prompt, earlier turns, tool or environment output) as one prompt with n=1, every trajectory of a batch in
one call; it appends the turn's generated tokens with response mask 1 and the tokens it renders itself (tool
results) with 0, so that a trajectory is one Generation whatever the number of turns, with its AgentTrace.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from fsdptrain.registry import Registry

if TYPE_CHECKING:
    from fsdptrain.rl.rollout.vllm import EngineSettings


@dataclass
class AgentTrace:
    """What a multi-turn trajectory did: its messages after the prompt, for the dumps and the drift check, and the
    counts and scores that reach the reward function (`reward_info`) and the metrics."""

    messages: list[dict] = field(default_factory=list)  # role, content, and `trained`: whether its tokens have mask 1
    assistant_turns: int = 0
    user_turns: int = 0  # replies of an interaction (a simulated user, an environment)
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised or named no tool
    tool_timeouts: int = 0
    format_errors: int = 0  # malformed tool-call blocks
    tool_rewards: list[float] = field(default_factory=list)  # each call's step reward, as the tool's execute gave it
    tool_scores: dict[str, float] = field(default_factory=dict)  # each tool's calc_reward when the trajectory ended
    turn_scores: list[float] = field(default_factory=list)  # each interaction reply's score
    success: bool | None = None  # an environment's `success` at its last step
    drift: bool | None = None  # a full re-render tokenizes otherwise (None: not checked)

    @property
    def num_turns(self) -> int:
        """verl's count: assistant turns, interaction replies, and the prompt."""
        return self.assistant_turns + self.user_turns + 1

    def reward_info(self) -> dict:
        """What the reward function finds in its `extra_info` besides the row's own (verl's names)."""
        return {"num_turns": self.num_turns, "tool_rewards": list(self.tool_rewards), "rollout_reward_scores": dict(self.tool_scores),
                "turn_scores": list(self.turn_scores), "tool_calls": self.tool_calls}


@dataclass
class Generation:
    prompt_ids: list[int]
    response_ids: list[int]  # through the first end-of-turn token, or max_new_tokens of them
    response_mask: list[int]  # 1 on tokens the policy produced (a multi-turn rollout gives tool output 0)
    log_probs: list[float] | None  # with calculate_log_probs, the sampling log-probs: after temperature, top-k and top-p
    truncated: bool  # stopped by max_new_tokens (a multi-turn trajectory: by its response budget) before an end token
    trace: AgentTrace | None = None  # a multi-turn trajectory's

    @property
    def mask(self) -> torch.Tensor:
        """response_mask as float weights for per-token sums over the response."""
        return torch.tensor(self.response_mask, dtype=torch.float32)

    @property
    def generated_tokens(self) -> int:
        """The tokens the policy produced (a multi-turn trajectory's tool and user tokens are not)."""
        return sum(self.response_mask)


def group_ids(num_prompts: int, n: int) -> list[int]:
    """Each response's group, the index of the prompt it answers, in what `RolloutEngine.generate` returns (`n` in a
    row): the one place that reads that order. Every later stage (scores, shaping, advantages, metrics) reads the
    ids, so that groups of any size and order work."""
    return [i for i in range(num_prompts) for _ in range(n)]


def members(ids: Sequence[int]) -> list[int]:
    """Each response's place in its group (0 for the first response of its group id), to name it in an error."""
    seen: dict[int, int] = {}
    places = []
    for group in ids:
        places.append(seen.get(group, 0))
        seen[group] = places[-1] + 1
    return places


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples from the policy's weights, which the trainer sends after every update."""

    dtype: torch.dtype  # the dtype `update_weights` expects its tensors in
    group: dist.ProcessGroup | None  # the ranks that share this engine and call it together (None: this rank alone)

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
        """Free the accelerator memory the engine holds between rollouts (where it can); a sleeping engine is left
        as it is."""
        ...

    def wake_up(self) -> None:
        """Ready the engine to generate and to take weights; an awake engine is left as it is."""
        ...

    def shutdown(self) -> None:
        """Release the engine; called once, after the job's last collective."""
        ...


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
    vllm: "EngineSettings"
    beam_search: bool = False  # rollout.beam_search (the hf engine's): a prompt's n responses are its n beams
    catalog_file: str | None = None  # rollout.catalog_file: responses constrained to its items (rollout/beams.py)


# Each engine's module registers the function that builds it from an EngineSpec (rollout.name selects it).
ROLLOUT_ENGINES: Registry[Callable[[EngineSpec], RolloutEngine]] = Registry("rollout engine")
