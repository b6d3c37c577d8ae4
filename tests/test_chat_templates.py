"""Loss masks on the real chat templates of Qwen2.5, Qwen3, Llama-3.1/3.2, Phi-3, Gemma and Mistral v0.3
(tests/data/chat_templates, on SmolLM2's vocabulary with each family's control tokens flagged as its tokenizer
flags them), against a reference that finds each assistant turn in the rendered text from the template's own
delimiters: the header that opens an assistant turn and the token that closes it."""

import copy
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken

from fsdptrain.data.chat import RowError, tokenize_conversation, tokenize_prompt_response

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"

CHATML = dict(special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              plain=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
              eos="<|im_end|>")
FAMILIES = {
    "qwen2_5": CHATML,
    "qwen3": CHATML,
    "llama3_1": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                              "<|eom_id|>", "<|python_tag|>"], bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "phi3": dict(special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], rstrip=True, bos="<s>", eos="<|endoftext|>"),
    "gemma": dict(special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>"),
    "mistral": dict(special=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                             "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], bos="<s>", eos="</s>"),
}
FAMILIES["llama3_2"] = FAMILIES["llama3_1"]

# Where an assistant turn starts (just after) and the token that closes it, as each template writes them.
TURNS = {
    "qwen2_5": (r"<\|im_start\|>assistant\n", "<|im_end|>"),
    "qwen3": (r"<\|im_start\|>assistant\n", "<|im_end|>"),
    "llama3_1": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", "<|eot_id|>"),
    "llama3_2": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", "<|eot_id|>"),
    "phi3": (r"<\|assistant\|>\n", "<|end|>"),
    "gemma": (r"<start_of_turn>model\n", "<end_of_turn>"),
    # Mistral writes no assistant header: a turn follows the user's [/INST] or the tool results, unless
    # more tool results or the next user message come first.
    "mistral": (r"(?:\[/INST\]|\[/TOOL_RESULTS\])(?!\[TOOL_RESULTS\]|\[INST\])", "</s>"),
}


def template_tokenizer(tokenizer_dir: str, name: str):
    """SmolLM2's vocabulary with the chat template `name` and its family's control tokens, flagged as its tokenizer
    flags them."""
    from transformers import AutoTokenizer

    flags = FAMILIES[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, rstrip=flags.get("rstrip", False), normalized=False, special=True)
                                                          for t in flags["special"]]}, replace_extra_special_tokens=False)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in flags.get("plain", [])])
    tok.bos_token = flags.get("bos")
    tok.eos_token = flags["eos"]
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tokenizer_dir):
    return request.param, template_tokenizer(tokenizer_dir, request.param)


def reference_mask(name: str, tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Ids of the rendered text and the mask of the tokens that start inside an assistant turn (header excluded,
    closing token included), the turns found by the template's delimiters."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    header, close = TURNS[name]
    spans = []
    for match in re.finditer(header, text):
        end = text.find(close, match.end())
        if end >= 0:
            spans.append((match.end(), end + len(close)))
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding["offset_mapping"]]
    return encoding["input_ids"], mask


CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = {
    "one-exchange": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    "system-and-turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome."},
    ],
    "non-ascii": [{"role": "user", "content": "Traduis « bonjour » en japonais 🙂"},
                  {"role": "assistant", "content": "こんにちは — «konnichiwa» 🎌"}],
    "whitespace-at-edges": [{"role": "user", "content": "\n  spaced question  "}, {"role": "assistant", "content": "  padded answer \n"},
                            {"role": "user", "content": "again"}, {"role": "assistant", "content": "\n\nleading newlines"}],
    "empty-final-content": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    "tool-call-no-content": [
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call12345", "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "tool-call-with-content": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call12345", "name": "get_weather"},
        {"role": "assistant", "content": "21 degrees."}, {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Anytime."},
    ],
    "reasoning-last-turn": [{"role": "user", "content": "2+3?"},
                            {"role": "assistant", "content": "5", "reasoning_content": "Two plus three is five."}],
    "reasoning-earlier-turns": [
        {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5", "reasoning_content": "Add them."},
        {"role": "user", "content": "Times 2?"}, {"role": "assistant", "content": "10", "reasoning_content": "Double five."},
    ],
    "reasoning-in-tool-turns": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "I need the tool."},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call12345", "name": "get_weather"},
        {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool said 21."},
        {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "I cannot tell."},
    ],
    "inline-think": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}],
    "parquet-nones": [
        {"role": "user", "content": "Hi", "tool_calls": None, "reasoning_content": None, "tool_call_id": None},
        {"role": "assistant", "content": "Hello", "tool_calls": None, "reasoning_content": None, "tool_call_id": None},
    ],
}


def template_accepts(tokenizer, messages, tools) -> bool:
    try:
        tokenizer.apply_chat_template([{k: v for k, v in m.items() if v is not None} for m in messages], tools=tools, tokenize=False)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_mask_equals_the_delimiter_reference(family, conversation, with_tools):
    name, tokenizer = family
    messages, tools = copy.deepcopy(CONVERSATIONS[conversation]), TOOLS if with_tools else None
    if not template_accepts(tokenizer, messages, tools):
        pytest.skip(f"the {name} template itself rejects this conversation")
    ids, mask = tokenize_conversation(tokenizer, messages, tools)  # a conversation the template accepts is never rejected
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    assert ids == list(tokenizer.apply_chat_template(clean, tools=tools, tokenize=True, return_dict=True)["input_ids"])
    text = tokenizer.apply_chat_template(clean, tools=tools, tokenize=False)
    expected_ids, expected_mask = reference_mask(name, tokenizer, text)
    assert ids == expected_ids
    assert mask == expected_mask, "\n".join(
        f"{'>' if m else ' '}{'>' if e else ' '} {tokenizer.decode([t])!r}" for t, m, e in zip(ids, mask, expected_mask) if m != e or e
    )
    assert sum(mask) >= sum(m["role"] == "assistant" for m in messages)  # every turn trains at least its closing token


def test_every_template_trains_tool_calls_and_reasoning_where_it_renders_them(family):
    name, tokenizer = family
    trained = lambda messages: tokenizer.decode([t for t, m in zip(*tokenize_conversation(tokenizer, messages)) if m])  # noqa: E731
    call = CONVERSATIONS["tool-call-no-content"]
    if template_accepts(tokenizer, call, None) and '"get_weather"' in tokenizer.apply_chat_template(call, tokenize=False):
        assert "get_weather" in trained(call)  # Phi-3 and Gemma's templates drop tool calls; the others render them
    if name == "qwen3":
        assert "Double five." in trained(CONVERSATIONS["reasoning-earlier-turns"])  # the last turn keeps its reasoning
        assert "Add them." not in tokenizer.decode(tokenize_conversation(tokenizer, CONVERSATIONS["reasoning-earlier-turns"])[0])


def test_single_turn_rows_end_like_multi_turn_rows(family):
    """A prompt/response row is a one-user, one-assistant conversation: the same closing token as multi-turn data
    (for Phi-3 and Gemma the tokenizer's EOS is another token)."""
    name, tokenizer = family
    single = tokenize_prompt_response(tokenizer, "Hi", "Hello! How can I help?")
    assert single == tokenize_conversation(tokenizer, CONVERSATIONS["one-exchange"])
    ids, mask = single
    last_trained = max(i for i, m in enumerate(mask) if m)
    assert tokenizer.convert_ids_to_tokens(ids[last_trained]) == TURNS[name][1]


def test_qwen3_split_turns_trains_each_turn_as_generated(family):
    name, tokenizer = family
    if name != "qwen3":
        pytest.skip("Qwen3 is the template that renders history differently from generation")
    messages = CONVERSATIONS["reasoning-earlier-turns"]
    first_turn = tokenize_conversation(tokenizer, messages[:2], only_last_turn=True)
    decoded = tokenizer.decode([t for t, m in zip(*first_turn) if m])
    assert decoded == "<think>\nAdd them.\n</think>\n\n5<|im_end|>"


def test_template_errors_name_the_template(family):
    name, tokenizer = family
    if name not in ("gemma", "mistral"):
        pytest.skip("these templates accept any role order")
    with pytest.raises(RowError, match="the chat template failed"):
        tokenize_conversation(tokenizer, [{"role": "assistant", "content": "first"}, {"role": "assistant", "content": "twice"}])


def test_preview_marks_the_trained_tokens_of_a_parquet_file(tmp_path, tokenizer_dir, tokenizer, capsys):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdptrain.data import preview

    rows = [CONVERSATIONS["one-exchange"], CONVERSATIONS["system-and-turns"]]
    path = str(tmp_path / "chats.parquet")
    pq.write_table(pa.table({"messages": rows}), path)
    arguments = [path, "--tokenizer", tokenizer_dir, "--rows", "0,1", "data.multiturn.enable=true"]
    preview.main(arguments)
    text = capsys.readouterr().out
    assert "[[Hello! How can I help?<|im_end|>]]" in text and "[[6, of course.<|im_end|>]]" in text
    assert "row 1, sample 0:" in text and "[[2+2?" not in text
    preview.main([*arguments, "--json"])
    for line, messages in zip(capsys.readouterr().out.splitlines(), rows):
        sample = json.loads(line)
        assert (sample["input_ids"], sample["loss_mask"]) == tuple(map(list, tokenize_conversation(tokenizer, messages)))
    with pytest.raises(SystemExit, match="data.no_such_key"):
        preview.main([*arguments, "data.no_such_key=1"])


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncated_and_single_turn_samples_equal_the_reference(family, mode):
    """Truncation cuts the reference's ids and mask as it cuts the rendered conversation; single-turn rows are the
    reference's one-exchange conversation."""
    from fsdptrain.data.dataset import truncate

    name, tokenizer = family
    messages = CONVERSATIONS["system-and-turns"]
    if not template_accepts(tokenizer, messages, None):
        messages = messages[1:]  # Gemma has no system role
    ids, mask = tokenize_conversation(tokenizer, messages)
    expected_ids, expected_mask = reference_mask(name, tokenizer, tokenizer.apply_chat_template(messages, tokenize=False))
    keep = slice(-30, None) if mode == "left" else slice(0, 30)
    assert truncate(ids, mask, 30, mode) == (expected_ids[keep], expected_mask[keep])
    exchange = CONVERSATIONS["one-exchange"]
    single = tokenize_prompt_response(tokenizer, exchange[0]["content"], exchange[1]["content"])
    assert list(single) == list(reference_mask(name, tokenizer, tokenizer.apply_chat_template(exchange, tokenize=False)))
