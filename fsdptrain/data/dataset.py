"""SFT samples from parquet files: every row is read, checked and tokenized when the dataset loads."""

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from fsdptrain.config.sft import DataConfig
from fsdptrain.data.chat import RowError, normalize_messages, tokenize_conversation, tokenize_prompt_response
from fsdptrain.data.images import ImageReader
from fsdptrain.errors import UserError

log = logging.getLogger("fsdptrain")


class DataError(UserError, ValueError):
    """A data file or row that cannot be used; the message names the file and the row."""


@dataclass
class Sample:
    input_ids: torch.Tensor  # (length,) int64
    loss_mask: torch.Tensor  # (length,) int64, 1 where the token is a training target
    # Per-token loss inputs aligned with input_ids along their first dimension (an RL advantage, an old log-prob, a
    # teacher's top-k): collation shifts them like the labels, so each sits at the position that predicts its token.
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)
    # Leading tokens (an RL prompt) that a packed row may hold once for the samples next to it that begin with
    # the same ones; 0: none.
    shared_prefix: int = 0
    # A vision-language model's inputs of the sample's images (data/images.py), and its (3, length) rotary positions
    # (models/vision.py); None for a text sample (its positions are the plain ones).
    images: dict[str, torch.Tensor] | None = None
    positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.numel()


def truncate(ids: list[int], mask: list[int], max_length: int, mode: str) -> tuple:
    if len(ids) <= max_length:
        return ids, mask
    if mode == "left":
        return ids[-max_length:], mask[-max_length:]
    if mode == "right":
        return ids[:max_length], mask[:max_length]
    raise RowError(f"{len(ids)} tokens exceed data.max_length={max_length} (data.truncation=error)")


def check_files_exist(files: dict[str, Sequence[str]]) -> None:
    """Every data file named under each key (data.train_files, data.val_files) exists: checked before any work
    starts, on every rank alike."""
    for key, paths in files.items():
        missing = [path for path in paths if not os.path.isfile(path)]
        if missing:
            raise DataError(f"{key}: no such data file: {', '.join(missing)}")


MEDIA_COLUMNS = ("images", "image", "videos", "video", "audios", "audio")  # verl's image_key/video_key defaults, and the singulars


def refuse_media(table, path: str, image_key: str | None = None) -> None:
    """A data file whose rows carry images, videos or audio is refused, whatever the keys, but for the images of
    `image_key` where the model reads them: training on the text alone would be a silently different run."""
    for name in MEDIA_COLUMNS:
        if name in table.column_names and name != image_key:
            row = next((i for i, value in enumerate(table.column(name).to_pylist()) if value not in (None, [], "", {})), None)
            if row is not None:
                raise DataError(f"{path} row {row}: column {name!r} holds media that this run does not read: images train with a "
                                "vision-language model (data.image_key names their column); videos and audio are not supported")


def _read_columns(path: str, columns: Sequence[str], optional: Sequence[str] = (), image_key: str | None = None) -> dict:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: cannot be read as parquet: {e}") from None
    refuse_media(table, path, image_key)
    optional = [*optional, *([image_key] if image_key else [])]
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; the file has {table.column_names}")
    present = list(columns) + [c for c in optional if c in table.column_names]
    return {c: table.column(c).to_pylist() for c in present}


def read_data_columns(path: str, config: DataConfig, image_key: str | None = None) -> dict[str, list]:
    """The columns of a parquet file that `config` reads (messages and tools, or prompt and response; the images
    of `image_key` where the model reads them)."""
    if config.multiturn.enable:
        return _read_columns(path, [config.multiturn.messages_key], optional=[config.multiturn.tools_key], image_key=image_key)
    return _read_columns(path, [config.prompt_key, config.response_key], image_key=image_key)


def nested(value, keys: Sequence[str], column: str):
    """`value[k1][k2]...` for data.prompt_dict_keys / response_dict_keys (verl's path into a column of dicts)."""
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise RowError(f"{column}: no key {key!r} in {str(value)[:100]!r} (data.*_dict_keys={list(keys)})")
        value = value[key]
    return value


def row_values(columns: dict[str, list], row: int) -> dict:
    """One row's value of each column."""
    return {name: values[row] for name, values in columns.items()}


def tokenize_row(tokenizer: PreTrainedTokenizerBase, config: DataConfig, row: dict) -> list[tuple]:
    """(ids, mask) of each sample a row (its columns' values) makes: one, or with multiturn.split_turns one per
    assistant turn."""
    kwargs = config.apply_chat_template_kwargs
    if not config.multiturn.enable:
        prompt = nested(row[config.prompt_key], config.prompt_dict_keys, f"data.prompt_key={config.prompt_key}")
        response = nested(row[config.response_key], config.response_dict_keys, f"data.response_key={config.response_key}")
        return [tokenize_prompt_response(tokenizer, prompt, response, kwargs)]
    tools = row.get(config.multiturn.tools_key)
    messages = row[config.multiturn.messages_key]
    if not config.multiturn.split_turns:
        return [tokenize_conversation(tokenizer, messages, tools, kwargs)]
    messages = normalize_messages(messages)
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [tokenize_conversation(tokenizer, messages[:end], tools, kwargs, only_last_turn=True) for end in ends]


def row_texts(config: DataConfig, row: dict) -> list[str]:
    """The texts of a row that may mark its images: the prompt and response, or each message's content."""
    if not config.multiturn.enable:
        return [nested(row[config.prompt_key], config.prompt_dict_keys, f"data.prompt_key={config.prompt_key}"),
                nested(row[config.response_key], config.response_dict_keys, f"data.response_key={config.response_key}")]
    return [m["content"] for m in row[config.multiturn.messages_key] or [] if isinstance(m, dict) and isinstance(m.get("content"), str)]


def with_images_marked(config: DataConfig, row: dict, reader: ImageReader) -> dict:
    """The row with each `<image>` of its texts written as the model's chat template writes an image."""
    if not config.multiturn.enable:
        if config.prompt_dict_keys or config.response_dict_keys:
            raise RowError("images with data.prompt_dict_keys / response_dict_keys are not read: put the text in the columns themselves")
        return {**row, config.prompt_key: reader.mark(row[config.prompt_key]), config.response_key: reader.mark(row[config.response_key])}
    messages = [{**m, "content": reader.mark(m["content"])} if isinstance(m, dict) and isinstance(m.get("content"), str) else m
                for m in row[config.multiturn.messages_key]]
    return {**row, config.multiturn.messages_key: messages}


def row_samples(tokenizer: PreTrainedTokenizerBase, config: DataConfig, row: dict, reader: ImageReader | None) -> list[Sample]:
    """The samples of one row, truncated; with a vision-language model's `reader`, with the row's images."""
    images = reader.read(row.get(reader.key), row_texts(config, row)) if reader is not None else None
    if images is None:
        made = [truncate(ids, mask, config.max_length, config.truncation) for ids, mask in tokenize_row(tokenizer, config, row)]
        return [Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)) for ids, mask in made]
    if config.multiturn.enable and config.multiturn.split_turns:
        raise RowError("data.multiturn.split_turns does not take a row with images: each turn's sample would need the images before it")
    (ids, mask), = tokenize_row(tokenizer, config, with_images_marked(config, row, reader))
    ids, mask = reader.expand(ids, mask, images)
    if len(ids) > config.max_length:
        raise RowError(f"{len(ids)} tokens with its images exceed data.max_length={config.max_length} (a sample with images is never "
                       "truncated: a cut image would not match its patches)")
    input_ids = torch.tensor(ids, dtype=torch.long)
    return [Sample(input_ids, torch.tensor(mask, dtype=torch.long), images=images, positions=reader.tokens.positions(input_ids, images["image_grid_thw"]))]


def load_sft_samples(files: Sequence[str], tokenizer: PreTrainedTokenizerBase, config: DataConfig, images: ImageReader | None = None) -> list[Sample]:
    """Read, check and tokenize every row of `files` in order (with a vision-language model's `images` reader, the
    rows' images too). A bad row raises naming file, row and problem, or with data.skip_bad_rows is skipped and
    counted; samples that truncation leaves without a trained token are dropped and counted."""
    samples, bad, untrained = [], [], 0
    for path in files:
        columns = read_data_columns(path, config, images.key if images is not None else None)
        for row in range(len(next(iter(columns.values())))):
            try:
                made = row_samples(tokenizer, config, row_values(columns, row), images)
            except RowError as e:
                if not config.skip_bad_rows:
                    raise DataError(f"{path} row {row}: {e}") from None
                bad.append(f"{path} row {row}: {e}")
                continue
            for sample in made:
                if sample.loss_mask[1:].sum() == 0:  # the first token is never a target: nothing predicts it
                    untrained += 1
                    continue
                samples.append(sample)
    if bad:
        log.warning("skipped %d bad row(s) (data.skip_bad_rows=true); the first: %s", len(bad), "; ".join(bad[:3]))
    if untrained:
        log.warning(
            "dropped %d sample(s) with no trained token after data.truncation=%s at data.max_length=%d",
            untrained, config.truncation, config.max_length,
        )
    if not samples:
        raise DataError(f"{', '.join(files)}: no usable rows")
    return samples
