"""Tool calls parsed from an assistant turn's text, in the chat template's own format
(actor_rollout_ref.rollout.multi_turn.format)."""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdptrain.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    calls: list[ToolCall]
    malformed: int  # tool-call blocks that are not a JSON object with a string `name` and object `arguments`


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
LLAMA_SEPARATOR = re.compile(r"\s*;\s*")


def as_call(call: Any) -> ToolCall | None:
    """A decoded call object as a ToolCall: a string `name` and an object of arguments (`arguments`, or Llama's
    `parameters`; some models write it as a JSON string, as OpenAI's API does); None where it is not one."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(call["name"], arguments) if isinstance(arguments, dict) else None


# multi_turn.format -> the parser of that format
TOOL_CALL_FORMATS: Registry[Callable[[str], "ParsedTurn"]] = Registry("tool-call format")


@TOOL_CALL_FORMATS.register("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks. An opened
    block that never closes counts as malformed."""
    calls, malformed = [], 0
    for body in HERMES_CALL.findall(text):
        try:
            call = as_call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            malformed += 1
        else:
            calls.append(call)
    malformed += max(text.count("<tool_call>") - text.count("</tool_call>"), 0)
    return ParsedTurn(calls, malformed)


@TOOL_CALL_FORMATS.register("llama3_json")
def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.1's and 3.2's JSON tool calls, as their template renders them: the whole turn is
    `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` where the model writes one), several separated by
    `;`. A turn that opens with `{` but is not such calls counts as malformed; any other turn is an answer."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn([], 0)
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            decoded, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return ParsedTurn(calls, 1)
        if (call := as_call(decoded)) is None:
            return ParsedTurn(calls, 1)
        calls.append(call)
        if (separator := LLAMA_SEPARATOR.match(body, position)) is None:
            return ParsedTurn(calls, int(bool(body[position:].strip())))  # text after the calls: not the template's form
        position = separator.end()
    return ParsedTurn(calls, 0)

