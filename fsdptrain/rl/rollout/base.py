"""The contract every rollout engine satisfies (hf.py, vllm.py), and what it returns.

A multi-turn agent loop (rl/agent/loop.py) drives the same call turn by turn: each live trajectory's token ids so
far (its prompt, earlier turns, tool or environment output) as one prompt with n=1, every trajectory of a batch in
one call; it appends the turn's generated tokens with response mask 1 and the tokens it renders itself (tool
results) with 0, so that a trajectory is one Generation whatever the number of turns, with its AgentTrace.
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from fsdptrain.data.images import Images
from fsdptrain.registry import Registry


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
    versions: list[int] | None = None  # partial rollouts: the policy version that drew each response token
    images: Images | None = None  # a vision-language model's prompt images (the agent loop sets them)

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
        of the engine calls it, each with its own prompts (or none). An engine that declares EngineInfo.images
        also takes `images=`: a vision-language model's images of each prompt (None for a text prompt)."""
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
    """What any engine is built from; `settings` holds the engine's own (its EngineInfo.settings)."""

    path: str
    dtype: torch.dtype
    device: torch.device
    pad_id: int
    trust_remote_code: bool
    max_model_len: int
    seed: int  # the same on every rank of one engine
    tensor_parallel_size: int
    free_cache_engine: bool  # sleep between rollouts where the platform can (CUDA), freeing the accelerator for training
    settings: Any  # an instance of the engine's EngineInfo.settings
    distributed: bool = True  # in a torchrun job, its ranks sharing engines; False: one process alone (evaluate.py)


@dataclass(frozen=True)
class EnginePlacement:
    """Where a run's engines are: what an engine's settings are checked against."""

    device: torch.device
    engines_on_host: int  # engines sharing one host's memory


def no_check(settings: Any, placement: EnginePlacement) -> Any:
    """An engine whose settings need nothing of where it runs."""
    return settings


def no_architecture_check(model_type: str, spec: "EngineSpec") -> None:
    return None


@dataclass(frozen=True)
class EngineInfo:
    """A rollout engine's declaration: its own settings and what it can do. The plan reads the settings' fields
    from the rollout section by name, checks them with `check`, and refuses what the engine cannot do, without
    naming an engine."""

    settings: type  # a dataclass of the engine's own settings, each field named as its key in actor_rollout_ref.rollout
    check: Callable[[Any, EnginePlacement], Any] = no_check  # the settings against the placement, what is null filled in (ConfigError naming the key)
    beams: bool = False  # answers a prompt with its n best beams (settings.beam_search)
    constrained: bool = False  # restricts responses to a catalog's items (settings.catalog_file)
    always_logs_probs: bool = False  # returns its sampling log-probs on every call: the plan compares them with the trainer's
    package: str | None = None  # the optional package it imports (config.base.PACKAGES), checked before any work
    own_world: bool = False  # builds itself over its process's torch.distributed world: a standalone rollout rank runs it in a process of its own
    check_architecture: Callable[[str, "EngineSpec"], None] = no_architecture_check  # a model type it cannot run right as specified (ConfigError)
    images: bool = False  # its generate takes a vision-language model's prompt images (`images=`, one a prompt)


def engine_settings(info: EngineInfo, values: Mapping[str, Any]) -> Any:
    """The engine's settings: each field named in `values` takes its value there, the others their defaults."""
    return info.settings(**{f.name: values[f.name] for f in fields(info.settings) if f.name in values})


# Each engine's module registers the function that builds it from an EngineSpec (rollout.name selects it), with its EngineInfo.
ROLLOUT_ENGINES: Registry[Callable[[EngineSpec], RolloutEngine]] = Registry("rollout engine")
