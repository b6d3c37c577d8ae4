"""Token-in, token-out: a trajectory keeps the ids the engine sampled as they are, and only what it appends (tool
results, a user's or an environment's reply) is rendered with the chat template. Re-rendering the whole
conversation after the rollout would tokenize differently from what was sampled (a newline lost after the end of
a turn, a tool call written back another way), and the trained tokens would no longer be the generated ones.

What is appended is the template's own rendering of the new messages after an assistant turn: everything a
probe conversation (a user message, an assistant answer, the new messages, the next generation prompt) renders
after the answer's end-of-turn token. That includes what the template writes between an assistant's end-of-turn
token and the next message (Qwen's newline after `<|im_end|>`), which the generated ids lack since generation
stops at the end-of-turn token, and it holds for templates that render a turn differently once others follow it
(Qwen3 drops the empty reasoning block of an assistant turn that is no longer the last).
"""

import json
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fsdptrain.data.chat import RowError, end_of_turn_ids, render
from fsdptrain.errors import ConfigError

PROBE = [{"role": "user", "content": "fsdptrain probe"}, {"role": "assistant", "content": "fsdptrain probe answer"}]


class TurnRenderer:
    """The token ids a trajectory appends for new messages, and the drift check against a full re-render."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[dict] | None, template_kwargs: dict, appended_roles: Sequence[str]):
        self.tokenizer, self.tools, self.template_kwargs = tokenizer, tools, dict(template_kwargs)
        (end_id,) = end_of_turn_ids(tokenizer, json.dumps(self.template_kwargs, sort_keys=True))
        self.end_text = tokenizer.convert_ids_to_tokens(end_id)
        for role in appended_roles:
            try:
                rendered = tokenizer.decode(self.append_ids([{"role": role, "content": "fsdptrain probe result"}]))
            except RowError as e:
                raise ConfigError(f"the chat template cannot append a {role} message after an assistant turn: {e}") from None
            if "fsdptrain probe result" not in rendered:
                raise ConfigError(f"the chat template renders no {role} message (it drops them): the model would never read them")

    def append_ids(self, messages: list[dict]) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token for `messages`, through the generation prompt
        of the next assistant turn."""
        text = render(self.tokenizer, PROBE + messages, self.tools, True, self.template_kwargs)
        answer_end = text.index(PROBE[-1]["content"]) + len(PROBE[-1]["content"])
        turn_end = text.find(self.end_text, answer_end)
        if turn_end < 0:
            raise RowError(f"the template writes no {self.end_text} after an assistant turn that other messages follow")
        return self.tokenizer(text[turn_end + len(self.end_text):], add_special_tokens=False)["input_ids"]

    def drifts(self, messages: list[dict], ids: list[int], mode: str) -> bool:
        """Whether a full re-render of the conversation `messages` (the prompt's, then every turn's, the assistant's
        as the text it generated) tokenizes to other ids than the trajectory's `ids` (prompt and response), up to
        their length; `ignore_strippable` compares without the tokens that are whitespace alone."""
        full = self.tokenizer(render(self.tokenizer, messages, self.tools, False, self.template_kwargs), add_special_tokens=False)["input_ids"]
        if mode == "ignore_strippable":
            ids, full = self.without_whitespace(ids), self.without_whitespace(full)
        return full[: len(ids)] != ids

    def without_whitespace(self, ids: list[int]) -> list[int]:
        return [token for token in ids if self.tokenizer.decode([token]).strip()]
