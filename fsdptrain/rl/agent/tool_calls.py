"""Tool calls parsed from an assistant turn's text, in the chat template's own format
(actor_rollout_ref.rollout.multi_turn.format)."""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall]
    malformed: int  # tool-call blocks that are not a JSON object with a string `name` and object `arguments`


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. An opened
    block that never closes counts as malformed."""
    calls, malformed = [], 0
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            malformed += 1
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            malformed += 1
            continue
        calls.append(ToolCall(call["name"], arguments))
    malformed += max(text.count("<tool_call>") - text.count("</tool_call>"), 0)
    return ParsedTurn(calls, malformed)


# multi_turn.format -> the parser of that format
TOOL_CALL_FORMATS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
