"""Turn conversations into token ids and a loss mask with the tokenizer's own chat template.

The ids are those of the template applied to the whole conversation. The loss mask covers each assistant
message's content and the end-of-turn token right after it, found by character offsets: the prefix before
an assistant message is the template rendered up to it with the generation prompt, so the content starts
where that prefix ends.
"""

import json
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """A data row that cannot be used; raised with the problem, and re-raised naming file and row."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: Any, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )


def check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RowError(f"messages must be a non-empty list, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is not a dict but {type(message).__name__}")
        if message.get("role") is None or message.get("content") is None:  # parquet reads absent fields as None
            raise RowError(f"message {i} lacks 'role' or 'content' (keys: {sorted(k for k, v in message.items() if v is not None)})")
        if message["role"] not in ROLES:
            raise RowError(f"message {i} has unknown role {message['role']!r} (allowed: {', '.join(ROLES)})")
        if not isinstance(message["content"], str):
            raise RowError(f"message {i} content is not a string but {type(message['content']).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("conversation has no assistant message")


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
    return list(tools)


def _content_span(full_text: str, prefix: str, content: str, index: int) -> tuple[int, int]:
    if not full_text.startswith(prefix):
        raise RowError(
            f"the chat template does not render messages[:{index}] as a prefix of the conversation, "
            "so assistant tokens cannot be located"
        )
    start = len(prefix)
    for candidate in (content, content.strip()):
        if full_text.startswith(candidate, start):
            return start, start + len(candidate)
    raise RowError(f"the chat template changed the content of assistant message {index}")


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], tools: Any = None
) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 loss mask over them. `tools`: a list of tool schemas
    (dicts) or its JSON string."""
    check_messages(messages)
    tools = parse_tools(tools)
    full_text = _render(tokenizer, messages, tools, generation_prompt=False)
    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    special_ids = set(tokenizer.all_special_ids)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:index], tools, generation_prompt=True)
        start, end = _content_span(full_text, prefix, message["content"], index)
        token = 0
        while token < len(ids) and offsets[token][1] <= start:
            token += 1
        while token < len(ids) and offsets[token][0] < end:
            mask[token] = 1
            token += 1
        if token < len(ids) and ids[token] in special_ids:  # the end-of-turn token that closes the message
            mask[token] = 1
    return ids, mask


def tokenize_prompt_response(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Single-turn data: the prompt as a user turn with the generation prompt, then the response and EOS."""
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise RowError("prompt and response must be strings")
    prompt_text = _render(tokenizer, [{"role": "user", "content": prompt}], None, generation_prompt=True)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)
