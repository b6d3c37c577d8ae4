"""The agent loops that answer prompts, by name (verl's `agent_name`): `single_turn_agent`, the engine's one turn,
and `tool_agent`, the multi-turn loop below; a user's loop registers in AGENT_LOOPS like these.

The multi-turn agent loop on the rollout contract: every live trajectory of a batch generates its next assistant
turn in one engine call; tool calls are parsed from the turn's text and run (concurrently, each cut at a timeout),
or an interaction answers the turn; their messages are appended as the template renders them (templates.py), with
response mask 0; until the model answers without a tool call, a turn cap, or the response budget
(data.max_response_length, every turn's tokens and every appended one together).

Tools and interactions are async (verl's interface); the loop runs them on its own event loop, between the
engine's calls. A tool that raises or names no tool answers the model with the error's text; a tool that hangs is
cut at `tool_timeout_s` (it must await, as async code does, for the cut to reach it); both are counted.
"""

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from fsdptrain.data.images import ImageReader
from fsdptrain.distributed.reductions import gather_lists
from fsdptrain.errors import ConfigError
from fsdptrain.registry import Registry
from fsdptrain.rl.agent.interactions import BaseInteraction
from fsdptrain.rl.agent.templates import TurnRenderer
from fsdptrain.rl.agent.tool_calls import TOOL_CALL_FORMATS, ParsedTurn, ToolCall
from fsdptrain.rl.agent.tools import BaseTool, response_text, tool_schemas
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import AgentTrace, Generation, RolloutEngine, group_ids

log = logging.getLogger("fsdptrain")



@dataclass(frozen=True)
class MultiTurnSettings:
    """actor_rollout_ref.rollout.multi_turn.*, verl's names."""

    max_assistant_turns: int | None
    max_user_turns: int | None
    max_parallel_calls: int  # tool calls run per assistant turn; further ones are dropped
    max_tool_response_length: int  # characters of a tool's response the model reads
    tool_response_truncate_side: str  # which part of a longer response is kept: left (its start), middle (both ends), right
    format: str  # the tool-call format, a key of TOOL_CALL_FORMATS
    tokenization_sanity_check_mode: str  # strict | ignore_strippable | disable
    tool_timeout_s: float


def truncate_response(text: str, limit: int, side: str) -> str:
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    return text[: limit // 2] + "...(truncated)..." + text[len(text) - limit // 2:]


@dataclass
class Trajectory:
    prompt: Prompt
    budget: int  # response tokens left
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] | None = None
    trace: AgentTrace = field(default_factory=AgentTrace)
    tool_instances: dict[str, str] = field(default_factory=dict)  # tool name -> this trajectory's instance id
    interaction: BaseInteraction | None = None
    interaction_id: str | None = None
    done: bool = False
    truncated: bool = False

    def append(self, ids: list[int], trained: bool, log_probs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(trained)] * len(ids)
        if self.log_probs is not None:
            self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.budget -= len(ids)

    def kwargs(self, tool: str, stage: str) -> dict:
        """verl's per-row `extra_info.tools_kwargs[tool][stage]` (create_kwargs, execute_kwargs, ...)."""
        return dict(((self.prompt.extra_info.get("tools_kwargs") or {}).get(tool) or {}).get(stage) or {})


class Loop(Protocol):
    """What answers prompts: `n` responses to each (n in a row), with RolloutEngine.generate's sampling arguments."""

    def generate(self, prompts: Sequence[Prompt], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        ...


@dataclass(frozen=True)
class LoopContext:
    """What an agent loop is built from. The engine may come later (None): a trainer builds its loops, and so
    checks their settings, before its processes start the engine."""

    engine: RolloutEngine | None
    tokenizer: PreTrainedTokenizerBase
    settings: MultiTurnSettings | None  # actor_rollout_ref.rollout.multi_turn's; None where multi_turn.enable=false
    tools: dict[str, BaseTool]
    interactions: dict[str, BaseInteraction]
    template_kwargs: dict  # data.apply_chat_template_kwargs
    images: ImageReader | None = None  # a vision-language model's: how its prompts' images become tokens


@dataclass(frozen=True)
class LoopInfo:
    images: bool = False  # it gives the engine each prompt's images (a loop that does not is refused rows with images)


# verl's agent loops by name: a data row's `agent_name`, else actor_rollout_ref.rollout.agent.default_agent_loop,
# selects the one that answers it. Each entry builds its loop from a LoopContext.
AGENT_LOOPS: Registry[Callable[[LoopContext], Loop]] = Registry("agent loop", LoopInfo())


@dataclass
class SingleTurn:
    """One turn: the engine answers the prompt's tokens."""

    engine: RolloutEngine

    def generate(self, prompts: Sequence[Prompt], **request) -> list[Generation]:
        if all(p.images is None for p in prompts):
            return self.engine.generate([p.ids for p in prompts], **request)
        generations = self.engine.generate([p.ids for p in prompts], images=[p.images for p in prompts], **request)
        for group, generation in zip(group_ids(len(prompts), request["n"]), generations):
            generation.images = prompts[group].images
        return generations


@AGENT_LOOPS.register("single_turn_agent", info=LoopInfo(images=True))
def single_turn_agent(context: LoopContext) -> SingleTurn:
    return SingleTurn(context.engine)


@AGENT_LOOPS.register("tool_agent", info=LoopInfo(images=True))
def tool_agent(context: LoopContext) -> "AgentLoop":
    if context.settings is None:
        raise ConfigError("the tool_agent loop answers over several turns: it needs actor_rollout_ref.rollout.multi_turn.enable=true with "
                          "a tool_config_path or an interaction_config_path")
    return AgentLoop(context.engine, context.tokenizer, context.settings, context.tools, context.interactions, context.template_kwargs,
                     context.images)


@dataclass
class AgentLoop:
    engine: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    settings: MultiTurnSettings
    tools: dict[str, BaseTool]
    interactions: dict[str, BaseInteraction]
    template_kwargs: dict = field(default_factory=dict)  # data.apply_chat_template_kwargs
    images: ImageReader | None = None  # a vision-language model's

    def __post_init__(self):
        self.events = asyncio.new_event_loop()
        self.parse = TOOL_CALL_FORMATS[self.settings.format]
        # Raises (ConfigError) where the template cannot render a tool's or an interaction's message.
        self.renderer = TurnRenderer(self.tokenizer, tool_schemas(self.tools), self.template_kwargs,
                                     ["tool"] * bool(self.tools) + ["user"] * bool(self.interactions))

    def generate(self, prompts: Sequence[Prompt], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False) -> list[Generation]:
        """`n` trajectories for each prompt (n in a row), each within `max_new_tokens` response tokens in all; the
        engine's sampling arguments as in RolloutEngine.generate."""
        trajectories = [Trajectory(prompt, max_new_tokens, log_probs=[] if calculate_log_probs else None) for prompt in prompts for _ in range(n)]
        try:
            self.run(self.start_interactions(trajectories))
            while budget := self.turn_budget(live := [t for t in trajectories if not t.done]):
                images = [t.prompt.images for t in live]  # a prompt's images, read again with its trajectory so far
                turns = self.engine.generate([t.prompt.ids + t.ids for t in live], n=1, max_new_tokens=budget,
                                             batch_size=batch_size, temperature=temperature, top_p=top_p, top_k=top_k, do_sample=do_sample,
                                             calculate_log_probs=calculate_log_probs,
                                             **({"images": images} if any(i is not None for i in images) else {}))
                calls = {id(t): self.take_turn(t, turn) for t, turn in zip(live, turns, strict=True)}
                self.run(together(self.answer(t, calls[id(t)]) for t in live if not t.done))
        finally:
            self.run(together(self.finish(t) for t in trajectories))
        for t in trajectories:
            if self.settings.tokenization_sanity_check_mode != "disable" and not t.truncated:
                messages, ids = self.conversation(t), t.prompt.ids + t.ids
                if t.prompt.images is not None:  # a re-render writes each image as its placeholder, one image token
                    messages, ids = [{**m, "content": self.images.mark(m["content"])} for m in messages], self.images.one_token_each(ids)
                t.trace.drift = self.renderer.drifts(messages, ids, self.settings.tokenization_sanity_check_mode)
        return [Generation(t.prompt.ids, t.ids, t.mask, t.log_probs, t.truncated, t.trace, images=t.prompt.images) for t in trajectories]

    def turn_budget(self, live: list[Trajectory]) -> int:
        """The next turn's max_new_tokens: the largest budget of a live trajectory, over every rank of a
        tensor-parallel engine (its ranks submit their pooled prompts together, with one setting, those done with
        none); 0 when every trajectory has ended. Each trajectory's turn is cut to its own budget after."""
        budget = max((t.budget for t in live), default=0)
        return budget if self.engine.group is None else max(gather_lists([budget], self.engine.group))

    def run(self, work):
        return self.events.run_until_complete(work)

    async def start_interactions(self, trajectories: list[Trajectory]) -> None:
        """The rows' interactions, by `extra_info.interaction_kwargs.name` (checked at load: interactions.check_interaction_names)."""
        for t in trajectories:
            kwargs = t.prompt.extra_info.get("interaction_kwargs")
            if self.interactions and kwargs:
                t.interaction = self.interactions[kwargs["name"]]
                t.interaction_id = await t.interaction.start_interaction(None, **kwargs)

    def take_turn(self, t: Trajectory, turn: Generation) -> list[ToolCall]:
        """Append the turn's tokens (cut to the budget); the tool calls to run, if the trajectory goes on."""
        kept = turn.response_ids[: t.budget]
        complete = not turn.truncated and len(kept) == len(turn.response_ids) > 0  # it ended on an end-of-turn token
        t.append(kept, trained=True, log_probs=None if turn.log_probs is None else turn.log_probs[: len(kept)])
        text = self.tokenizer.decode(kept[:-1] if complete else kept, skip_special_tokens=False)
        t.trace.messages.append({"role": "assistant", "content": text, "trained": True})
        t.trace.assistant_turns += 1
        if not complete:
            t.done, t.truncated = True, True
            return []
        parsed = self.parse(text) if self.tools else ParsedTurn([], 0)
        t.trace.format_errors += parsed.malformed
        turn_cap = self.settings.max_assistant_turns
        if t.budget <= 0 or (turn_cap is not None and t.trace.assistant_turns >= turn_cap):
            t.done = True
        elif not parsed.calls and (t.interaction is None or t.trace.user_turns == self.settings.max_user_turns):
            t.done = True
        return parsed.calls[: self.settings.max_parallel_calls]

    async def answer(self, t: Trajectory, calls: list[ToolCall]) -> None:
        """The tools' results, or else the interaction's reply, appended as the template renders them."""
        if calls:
            results = await together(self.call_tool(t, call) for call in calls)
            messages = [{"role": "tool", "content": truncate_response(text, self.settings.max_tool_response_length,
                                                                      self.settings.tool_response_truncate_side)} for text in results]
        else:
            conversation = self.conversation(t)
            stop, text, score, metrics = await t.interaction.generate_response(t.interaction_id, conversation,
                                                                                **(t.prompt.extra_info.get("interaction_kwargs") or {}))
            t.trace.turn_scores.append(float(score))
            if "success" in (metrics or {}):
                t.trace.success = bool(metrics["success"])
            if stop:
                t.done = True
                return
            t.trace.user_turns += 1
            messages = [{"role": "user", "content": text}]
        ids = self.renderer.append_ids(messages)
        if len(ids) >= t.budget:  # no room for the results and a reply to them: the trajectory ends without them
            t.done, t.truncated = True, True
            return
        t.append(ids, trained=False)
        t.trace.messages += [{**message, "trained": False} for message in messages]

    async def call_tool(self, t: Trajectory, call: ToolCall) -> str:
        t.trace.tool_calls += 1
        tool = self.tools.get(call.name)
        if tool is None:
            t.trace.tool_errors += 1
            return f"Error: no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}"

        async def create_and_execute():
            if call.name not in t.tool_instances:
                t.tool_instances[call.name] = instance_id(await tool.create(None, **t.kwargs(call.name, "create_kwargs")))
            return await tool.execute(t.tool_instances[call.name], call.arguments, **t.kwargs(call.name, "execute_kwargs"))

        try:
            response, reward, _ = await asyncio.wait_for(create_and_execute(), self.settings.tool_timeout_s)
        except asyncio.TimeoutError:
            t.trace.tool_timeouts += 1
            return f"Error: the tool {call.name} did not answer within {self.settings.tool_timeout_s:g} s"
        except Exception as e:  # a tool's failure is the model's to read, not the run's to die of
            t.trace.tool_errors += 1
            return f"Error: {type(e).__name__}: {e}"
        t.trace.tool_rewards.append(float(reward))
        return response_text(response, call.name)

    async def finish(self, t: Trajectory) -> None:
        """Each tool's reward for the trajectory, then its instance released; the interaction finalized."""
        for name, instance in t.tool_instances.items():
            tool = self.tools[name]
            t.trace.tool_scores[name] = float(await tool.calc_reward(instance, **t.kwargs(name, "calc_reward_kwargs")))
            await tool.release(instance, **t.kwargs(name, "release_kwargs"))
        t.tool_instances = {}
        if t.interaction is not None and t.interaction_id is not None:
            await t.interaction.finalize_interaction(t.interaction_id)
            t.interaction_id = None

    @staticmethod
    def conversation(t: Trajectory) -> list[dict]:
        return t.prompt.messages + [{"role": m["role"], "content": m["content"]} for m in t.trace.messages]


async def together(coroutines) -> list:
    return await asyncio.gather(*coroutines)


def instance_id(created) -> str:
    """verl's tools return the instance id from create, newer ones (id, ToolResponse)."""
    return created[0] if isinstance(created, tuple) else created
