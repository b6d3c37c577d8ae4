"""Every bad row fails at load naming file, row and problem; truncation modes do what they say."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from fsdptrain.config.base import defaults, to_typed
from fsdptrain.config.sft import DataConfig
from fsdptrain.data.chat import tokenize_conversation
from fsdptrain.data.dataset import DataError, load_sft_samples

GOOD = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]


def data_config(**overrides) -> DataConfig:
    base = defaults("sft_trainer").data
    base.train_files = "unused"
    base.multiturn.enable = True
    for key, value in overrides.items():
        OmegaConf.update(base, key.replace("__", "."), value)
    return to_typed(base, DataConfig)


def write(path, **columns) -> str:
    pq.write_table(pa.table(columns), str(path))
    return str(path)


@pytest.mark.parametrize(
    "rows, bad_row, problem",
    [
        ([GOOD, GOOD, [{"role": "user", "content": "Hi"}]], 2, "no assistant message"),
        ([GOOD, GOOD, [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]], 2, "unknown role 'wizard'"),
        ([GOOD, GOOD, [{"content": "x"}, {"role": "assistant", "content": "y"}]], 2, "unknown role None"),  # parquet's absent key
        # parquet cannot mix structs and strings in one column: a file of string lists
        ([["a string", "not a dict"]], 0, "message 0 is not a dict"),
    ],
)
def test_bad_row_names_file_row_and_problem(tmp_path, tokenizer, rows, bad_row, problem):
    path = write(tmp_path / "bad.parquet", messages=rows)
    with pytest.raises(DataError, match=rf"bad\.parquet row {bad_row}: .*{problem}"):
        load_sft_samples([write(tmp_path / "good.parquet", messages=[GOOD]), path], tokenizer, data_config())


def test_tools_column_of_json_strings(tmp_path, tokenizer):
    """A tools column of JSON strings is decoded per row; a row whose JSON is broken is named."""
    tools = '[{"type": "function", "function": {"name": "weather", "parameters": {}}}]'
    good = write(tmp_path / "tools.parquet", messages=[GOOD, GOOD], tools=[tools, None])
    assert len(load_sft_samples([good], tokenizer, data_config())) == 2
    bad = write(tmp_path / "bad.parquet", messages=[GOOD, GOOD], tools=[tools, tools[:-1]])
    with pytest.raises(DataError, match=r"bad\.parquet row 1: tools is a string but not valid JSON"):
        load_sft_samples([bad], tokenizer, data_config())


def test_missing_column_and_missing_file(tmp_path, tokenizer):
    path = write(tmp_path / "other.parquet", conversation=[GOOD])
    with pytest.raises(DataError, match=r"other\.parquet: missing column\(s\) \['messages'\]"):
        load_sft_samples([path], tokenizer, data_config())
    with pytest.raises(DataError, match=r"nowhere\.parquet: no such data file"):
        load_sft_samples([str(tmp_path / "nowhere.parquet")], tokenizer, data_config())
    with pytest.raises(DataError, match=r"response: missing column|missing column\(s\) \['prompt', 'response'\]"):
        load_sft_samples([path], tokenizer, data_config(multiturn__enable=False))


def test_over_long_row_under_truncation_error(tmp_path, tokenizer):
    long_row = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    path = write(tmp_path / "long.parquet", messages=[GOOD, long_row])
    with pytest.raises(DataError, match=r"long\.parquet row 1: \d+ tokens exceed data.max_length=64"):
        load_sft_samples([path], tokenizer, data_config(max_length=64, truncation="error"))


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_keeps_the_named_end(tmp_path, tokenizer, mode):
    conversation = [{"role": "user", "content": "count " * 5}, {"role": "assistant", "content": "done " * 60}]
    full_ids, full_mask = tokenize_conversation(tokenizer, conversation)
    path = write(tmp_path / "t.parquet", messages=[conversation])
    (sample,) = load_sft_samples([path], tokenizer, data_config(max_length=50, truncation=mode))
    expected = slice(-50, None) if mode == "left" else slice(0, 50)
    assert sample.input_ids.tolist() == full_ids[expected]
    assert sample.loss_mask.tolist() == full_mask[expected]


def test_single_turn_columns(tmp_path, tokenizer):
    path = write(tmp_path / "st.parquet", question=["1+1?", "2+2?"], answer=["2", "4"])
    samples = load_sft_samples([path], tokenizer, data_config(multiturn__enable=False, prompt_key="question", response_key="answer"))
    assert len(samples) == 2
    assert tokenizer.decode(samples[1].input_ids[samples[1].loss_mask.bool()]) == "4<|im_end|>"  # the template's end of turn


def test_files_are_concatenated_in_order(tmp_path, tokenizer):
    a = write(tmp_path / "a.parquet", messages=[GOOD])
    other = [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you."}]
    b = write(tmp_path / "b.parquet", messages=[other, GOOD])
    samples = load_sft_samples([a, b], tokenizer, data_config())
    assert [s.input_ids.tolist() for s in samples] == [
        tokenize_conversation(tokenizer, m)[0] for m in (GOOD, other, GOOD)
    ]


def test_samples_left_without_a_trained_token_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    """Right truncation that cuts off every assistant token leaves nothing to train: the sample is dropped, with a
    count in the log, never trained silently."""
    cut_off = [{"role": "user", "content": "count " * 80}, {"role": "assistant", "content": "done"}]
    path = write(tmp_path / "t.parquet", messages=[GOOD, cut_off, GOOD])
    with caplog.at_level("WARNING", logger="fsdptrain"):
        samples = load_sft_samples([path], tokenizer, data_config(max_length=50, truncation="right"))
    assert len(samples) == 2
    assert "dropped 1 sample(s) with no trained token after data.truncation=right at data.max_length=50" in caplog.text


def test_skip_bad_rows_counts_and_names_the_first(tmp_path, tokenizer, caplog):
    rows = [GOOD, [{"role": "user", "content": "Hi"}], GOOD, [{"role": "wizard", "content": "y"}]]
    path = write(tmp_path / "mixed.parquet", messages=rows)
    with caplog.at_level("WARNING", logger="fsdptrain"):
        samples = load_sft_samples([path], tokenizer, data_config(skip_bad_rows=True))
    assert len(samples) == 2
    assert "skipped 2 bad row(s)" in caplog.text and "mixed.parquet row 1: conversation has no assistant message" in caplog.text


def test_split_turns_makes_one_sample_per_assistant_turn(tmp_path, tokenizer):
    conversation = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    path = write(tmp_path / "s.parquet", messages=[conversation])
    first, second = load_sft_samples([path], tokenizer, data_config(multiturn__split_turns=True))
    assert tokenizer.decode(first.input_ids[first.loss_mask.bool()]) == "4<|im_end|>"
    assert tokenizer.decode(second.input_ids[second.loss_mask.bool()]) == "6<|im_end|>"  # the first turn is context only
    assert second.input_ids.tolist() == tokenize_conversation(tokenizer, conversation)[0]


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}{{ marker or '' }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant{{ marker or '' }}: {% endif %}"
    )
    path = write(tmp_path / "k.parquet", messages=[GOOD])
    (sample,) = load_sft_samples([path], tok, data_config(apply_chat_template_kwargs={"marker": " [kw]"}))
    assert "assistant [kw]" in tok.decode(sample.input_ids)


def test_rows_with_images_videos_or_audio_are_refused_whatever_the_keys(tmp_path, tokenizer):
    """A vision-language dataset (verl's `images` column) trains no text model silently: the file and the first
    row that carries media are named, for SFT and RL data alike; an all-empty media column is text data. (A
    vision-language model reads its images: tests/test_vision_language.py.)"""
    from fsdptrain.rl.data import load_prompts

    image = [{"bytes": b"\x89PNG", "path": None}]
    sft = write(tmp_path / "vl.parquet", messages=[GOOD, GOOD], images=[[], image])
    with pytest.raises(DataError, match=r"vl\.parquet row 1: column 'images' holds media that this run does not read: images train with a vision-language model"):
        load_sft_samples([sft], tokenizer, data_config())
    assert len(load_sft_samples([write(tmp_path / "text.parquet", messages=[GOOD], images=[[]])], tokenizer, data_config())) == 1
    rl = write(tmp_path / "rl_vl.parquet", prompt=[GOOD[:1]], data_source=["x"], ground_truth=["1"], videos=[["clip.mp4"]])
    with pytest.raises(DataError, match=r"rl_vl\.parquet row 0: column 'videos' holds media"):
        load_prompts([rl], tokenizer)


def test_a_multimodal_model_not_built_here_is_refused_by_its_config(tmp_path):
    """A model folder whose config has a vision tower of a type not supported (Idefics3's) is refused naming the key
    and the modality; a supported one (Qwen2-VL) loads."""
    from transformers import Idefics3Config, Qwen2VLConfig

    from fsdptrain.config.shared import ModelConfig
    from fsdptrain.errors import ConfigError
    from fsdptrain.models.loading import load_model_config

    Idefics3Config().save_pretrained(tmp_path / "idefics3")
    with pytest.raises(ConfigError, match=r"model\.path=.* is a multimodal model \(idefics3: vision_config\) that fsdptrain does not train"):
        load_model_config(str(tmp_path / "idefics3"), "model.path", ModelConfig(False, False, "auto"), sp_size=1)
    Qwen2VLConfig().save_pretrained(tmp_path / "qwen2_vl")
    assert load_model_config(str(tmp_path / "qwen2_vl"), "model.path", ModelConfig(False, False, "auto"), sp_size=2).model_type == "qwen2_vl"
