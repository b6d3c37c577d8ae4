"""Conversations to token ids and a loss mask, with the tokenizer's own chat template.

The rule:
- the ids are exactly those of the template applied to the whole conversation;
- the loss covers everything the assistant emits in each of its turns, as the template renders it there (content,
  tool calls, reasoning where the template renders it) through the end-of-turn token that closes the turn;
- nothing of system, user or tool messages, role headers or the generation prompt is trained.

A turn starts where the generation prompt that precedes it ends: the conversation up to the turn, rendered with
the generation prompt, is a prefix of the whole rendering for templates that keep earlier turns as they are. Some
templates render earlier messages differently depending on what follows (Mistral v0.3 writes the system prompt
into the last user message only; Qwen3 drops the reasoning of turns before the last user query): there the turn
starts after the longest tail of that prefix rendering found in the whole rendering, past the previous turn. A
turn ends at the first end-of-turn token after its start: the special token the template writes right after an
assistant message (found once per template by rendering a probe conversation).
"""

import json
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A data row that cannot be used; raised with the problem, and re-raised naming file and row."""


def normalize_messages(messages: Any, require_assistant: bool = True) -> list[dict]:
    """Check a conversation and return its messages without the keys parquet fills with None for a message that
    lacks them (templates test `message.tool_calls is defined`); absent content becomes ''. A prompt for
    generation (`require_assistant=False`) need not hold an assistant message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RowError(f"messages must be a non-empty list, got {type(messages).__name__}")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is not a dict but {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in ROLES:
            raise RowError(f"message {i} has unknown role {message.get('role')!r} (allowed: {', '.join(ROLES)})")
        message.setdefault("content", "")
        if not isinstance(message["content"], str):
            raise RowError(f"message {i} content is not a string but {type(message['content']).__name__}")
        normalized.append(message)
    if require_assistant and not any(m["role"] == "assistant" for m in normalized):
        raise RowError("conversation has no assistant message")
    return normalized


def parse_tools(tools: Any) -> list | None:
    """A row's tool schemas as the chat template wants them: a list of dicts. Parquet files often hold them as a
    JSON string (one schema per row varies too much for a struct column), which is decoded here."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RowError(f"tools is a string but not valid JSON: {e}") from None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, dict) for tool in tools):
        raise RowError(f"tools must be a list of dicts (or its JSON), got {type(tools).__name__}")
    return list(tools) or None


def render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: list | None, generation_prompt: bool, template_kwargs: dict
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
        )
    except Exception as e:  # jinja's raise_exception and template bugs surface as several exception types
        raise RowError(f"the chat template failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


@lru_cache(maxsize=16)
def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, template_kwargs_json: str) -> frozenset[int]:
    """The special tokens a template writes right after an assistant message's content."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "fsdptrain probe"}]
    text = render(tokenizer, probe, None, False, json.loads(template_kwargs_json))
    after = text[text.rindex("fsdptrain probe") + len("fsdptrain probe") :]
    special = set(tokenizer.all_special_ids)
    for token in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token in special:
            return frozenset({token})
    raise RowError("the chat template writes no special token after an assistant message: its turns cannot be delimited")


def _turn_start(prefix: str, full_text: str, search_from: int) -> int:
    """Where the assistant turn after `prefix` (the conversation before it, with the generation prompt) starts in
    the whole rendering."""
    agreed = len(os.path.commonprefix([prefix, full_text]))
    if agreed == len(prefix):
        return agreed
    # The template rendered something before this turn differently: take the longest tail of the prefix that
    # the whole rendering has after the previous turn.
    for start in range(agreed, len(prefix)):
        found = full_text.find(prefix[start:], search_from)
        if found >= 0:
            return found + len(prefix) - start
    raise RowError("the chat template's rendering of the conversation does not contain its generation prompt")


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: Any = None, template_kwargs: dict | None = None,
    only_last_turn: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 loss mask over them (the module's rule). `tools`: a list
    of tool schemas (dicts) or its JSON string. `only_last_turn`: train the last assistant turn alone."""
    messages = normalize_messages(messages)
    tools = parse_tools(tools)
    template_kwargs = dict(template_kwargs or {})
    full_text = render(tokenizer, messages, tools, False, template_kwargs)
    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    end_ids = end_of_turn_ids(tokenizer, json.dumps(template_kwargs, sort_keys=True))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    mask = [0] * len(ids)
    token, previous_end = 0, 0
    for index in turns:
        start = _turn_start(render(tokenizer, messages[:index], tools, True, template_kwargs), full_text, previous_end)
        while token < len(ids) and offsets[token][0] < start:
            token += 1
        first = token
        while token < len(ids) and ids[token] not in end_ids:
            token += 1
        if token == len(ids):
            raise RowError(f"assistant message {index} has no end-of-turn token in the rendered conversation")
        if not only_last_turn or index == turns[-1]:
            mask[first : token + 1] = [1] * (token + 1 - first)
        previous_end = offsets[token][1]
        token += 1
    return ids, mask


def tokenize_prompt_response(
    tokenizer: PreTrainedTokenizerBase, prompt: str, response: str, template_kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Single-turn data as a one-user, one-assistant conversation: it ends with the template's end-of-turn token,
    as multi-turn data and generation do."""
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise RowError("prompt and response must be strings")
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tokenize_conversation(tokenizer, messages, template_kwargs=template_kwargs)
