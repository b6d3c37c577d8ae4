"""SFT samples from parquet files: every row is read, checked and tokenized when the dataset loads."""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from fsdptrain.config.schema import DataConfig
from fsdptrain.data.chat import RowError, tokenize_conversation, tokenize_prompt_response


class DataError(ValueError):
    """A data file or row that cannot be used; the message names the file and the row."""


@dataclass
class Sample:
    input_ids: torch.Tensor  # (length,) int64
    loss_mask: torch.Tensor  # (length,) int64, 1 where the token is a training target
    # Per-token loss inputs aligned with input_ids (an RL advantage, an old log-prob): collation shifts them
    # like the labels, so each sits at the position that predicts its token.
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)

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


def _read_columns(path: str, columns: Sequence[str], optional: Sequence[str] = ()) -> dict:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such data file")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: cannot be read as parquet: {e}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; the file has {table.column_names}")
    present = list(columns) + [c for c in optional if c in table.column_names]
    return {c: table.column(c).to_pylist() for c in present}


def _tokenize_row(tokenizer: PreTrainedTokenizerBase, config: DataConfig, columns: dict, row: int) -> tuple:
    if config.multiturn.enable:
        tools = columns[config.multiturn.tools_key][row] if config.multiturn.tools_key in columns else None
        return tokenize_conversation(tokenizer, columns[config.multiturn.messages_key][row], tools)
    return tokenize_prompt_response(tokenizer, columns[config.prompt_key][row], columns[config.response_key][row])


def load_sft_samples(files: Sequence[str], tokenizer: PreTrainedTokenizerBase, config: DataConfig) -> list[Sample]:
    """Read, check and tokenize every row of `files` in order; the first bad row raises naming file and row."""
    if config.multiturn.enable:
        required = [config.multiturn.messages_key]
    else:
        required = [config.prompt_key, config.response_key]
    samples = []
    for path in files:
        columns = _read_columns(path, required, optional=[config.multiturn.tools_key] if config.multiturn.enable else [])
        for row in range(len(columns[required[0]])):
            try:
                ids, mask = _tokenize_row(tokenizer, config, columns, row)
                ids, mask = truncate(ids, mask, config.max_length, config.truncation)
            except RowError as e:
                raise DataError(f"{path} row {row}: {e}") from None
            samples.append(Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)))
    if not samples:
        raise DataError(f"{', '.join(files)}: no rows")
    return samples
