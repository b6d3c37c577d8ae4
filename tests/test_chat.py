"""Loss-token masks: exactly each assistant content plus its end-of-turn token, ids as the template gives."""

import json

import pytest

from fsdptrain.data.chat import RowError, tokenize_conversation, tokenize_prompt_response

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6, of course."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ],
    [
        {"role": "user", "content": "Traduis « bonjour » en japonais 🙂"},
        {"role": "assistant", "content": "こんにちは — «konnichiwa» 🎌"},
    ],
    [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Calling the tool."},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 degrees.\nLine two."},
    ],
]

# A second template whose turns end with a special token that is not EOS, with text after it.
PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}<|endoftext|>\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def template_ids(tokenizer, messages):
    encoded = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def loss_spans(ids, mask):
    """Runs of consecutive loss tokens."""
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


@pytest.fixture(params=["chatml", "plain"])
def templated(request, tokenizer):
    if request.param == "chatml":
        return tokenizer, "<|im_end|>"
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = PLAIN_TEMPLATE
    return tok, "<|endoftext|>"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_loss_tokens_are_assistant_contents_and_end_of_turn(templated, messages):
    tokenizer, end_of_turn = templated
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert ids == template_ids(tokenizer, messages)
    decoded = [tokenizer.decode(span) for span in loss_spans(ids, mask)]
    expected = [m["content"] + end_of_turn for m in messages if m["role"] == "assistant"]
    assert decoded == expected


def test_tools_are_passed_to_the_template(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}" + PLAIN_TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    ids, mask = tokenize_conversation(tok, CONVERSATIONS[3], tools)
    assert "TOOLS:" in tok.decode(ids) and "weather" in tok.decode(ids)
    assert [tok.decode(s) for s in loss_spans(ids, mask)] == ["Calling the tool.<|endoftext|>", "It is 21 degrees.\nLine two.<|endoftext|>"]


def test_tools_as_a_json_string_equal_the_decoded_list(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = "{% if tools %}TOOLS: {% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}" + PLAIN_TEMPLATE
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    as_string = tokenize_conversation(tok, CONVERSATIONS[3], json.dumps(tools))
    assert as_string == tokenize_conversation(tok, CONVERSATIONS[3], tools)
    assert "TOOLS: weather;" in tok.decode(as_string[0])  # fields reached the template, not a string's characters


@pytest.mark.parametrize("tools, problem", [("[{not json", "not valid JSON"), ('{"name": "x"}', "list of dicts"), ('["x"]', "list of dicts")])
def test_bad_tools_are_named(tokenizer, tools, problem):
    with pytest.raises(RowError, match=problem):
        tokenize_conversation(tokenizer, CONVERSATIONS[3], tools)


def test_single_turn_trains_on_response_and_the_end_of_turn_token(tokenizer):
    ids, mask = tokenize_prompt_response(tokenizer, "What is 1+1?", "Two.")
    assert [tokenizer.decode(s) for s in loss_spans(ids, mask)] == ["Two.<|im_end|>"]
    assert tokenizer.decode(ids).startswith(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+1?"}], tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize(
    "messages, problem",
    [
        ([], "non-empty list"),
        (["hello"], "message 0 is not a dict"),
        ([{"content": "x"}, {"role": "assistant", "content": "x"}], "message 0 has unknown role None"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([{"role": "user", "content": "x"}], "no assistant message"),
        ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "content is not a string"),
    ],
)
def test_bad_conversations_are_named(tokenizer, messages, problem):
    with pytest.raises(RowError, match=problem):
        tokenize_conversation(tokenizer, messages)
