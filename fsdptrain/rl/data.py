"""Prompts for RL and evaluation from verl's parquet layout: `prompt` (a chat message list), `data_source`,
`reward_model` (a struct with `ground_truth` and `style`) or a flat `ground_truth` column, and optional
`extra_info` and `agent_name` (verl's: the agent loop that answers the row), and for a vision-language model the
images of `data.image_key` (each `<image>` in the prompt's messages the next, data/images.py). Every row is checked
and its prompt tokenized (chat template with the generation prompt) at load."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq
import torch
from transformers import PreTrainedTokenizerBase

from fsdptrain.data.chat import RowError, normalize_messages, render
from fsdptrain.data.dataset import DataError, refuse_media
from fsdptrain.data.images import ImageReader, Images


@dataclass
class Prompt:
    ids: list[int]
    messages: list[dict]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    agent_name: str | None = None  # the row's agent loop (rl/agent/loop.py's AGENT_LOOPS); None: the run's default
    images: Images | None = None  # a vision-language model's images of the prompt
    stored_images: list | None = None  # those images as the row stores them (bytes, paths or dicts of them): a reward may read them


def _row_prompt(columns: dict, row: int, tokenizer: PreTrainedTokenizerBase, template_kwargs: dict, tools: list[dict] | None,
                reader: ImageReader | None) -> Prompt:
    messages = columns["prompt"][row]
    messages = normalize_messages(messages, require_assistant=False)
    images = stored = None
    if reader is not None:
        stored = list(columns[reader.key][row] or []) if reader.key in columns else []
        images = reader.read(stored, [m["content"] for m in messages])
    if "reward_model" in columns:
        reward_model = columns["reward_model"][row] or {}
        ground_truth = reward_model.get("ground_truth")
    else:
        ground_truth = columns["ground_truth"][row]
    if ground_truth is None:
        raise RowError("no ground truth (reward_model.ground_truth or ground_truth)")
    data_source = columns["data_source"][row] if "data_source" in columns else None
    if not isinstance(data_source, str) or not data_source:
        raise RowError(f"data_source must be a non-empty string, got {data_source!r}")
    text = render(tokenizer, [{**m, "content": reader.mark(m["content"])} for m in messages] if images else messages, tools, True, template_kwargs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if reader is not None:  # a text prompt is checked for image tokens written in its text
        ids, _ = reader.expand(ids, [0] * len(ids), images)
    if images is not None:
        images = Images(images, reader.tokens.positions(torch.tensor(ids), images["image_grid_thw"]))
    extra_info = columns["extra_info"][row] if "extra_info" in columns else None
    agent_name = columns["agent_name"][row] if "agent_name" in columns else None
    if agent_name is not None and (not isinstance(agent_name, str) or not agent_name):
        raise RowError(f"agent_name must be a non-empty string or null, got {agent_name!r}")
    return Prompt(ids, messages, data_source, ground_truth, dict(extra_info or {}), agent_name, images, stored or None)


def load_prompts(
    files: Sequence[str], tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None, tools: list[dict] | None = None,
    images: ImageReader | None = None,
) -> list[Prompt]:
    """Every row of `files` in order, rendered with the tool schemas `tools` (a multi-turn rollout's) where given,
    with a vision-language model's `images` reader its images; a bad row raises naming the file, the row and the
    problem."""
    prompts = []
    for path in files:
        try:
            table = pq.read_table(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such data file") from None
        except Exception as e:  # pyarrow raises several types for a file that is not parquet
            raise DataError(f"{path}: cannot be read as parquet: {e}") from None
        refuse_media(table, path, images.key if images is not None else None)
        names = table.column_names
        missing = [c for c in ("prompt", "data_source") if c not in names]
        if "reward_model" not in names and "ground_truth" not in names:
            missing.append("reward_model (or ground_truth)")
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; the file has {names}")
        read = ("prompt", "data_source", "reward_model", "ground_truth", "extra_info", "agent_name", *([images.key] if images is not None else []))
        columns = {c: table.column(c).to_pylist() for c in read if c in names}
        for row in range(table.num_rows):
            try:
                prompts.append(_row_prompt(columns, row, tokenizer, dict(template_kwargs or {}), tools, images))
            except RowError as e:
                raise DataError(f"{path} row {row}: {e}") from None
    if not prompts:
        raise DataError(f"{', '.join(files)}: no rows")
    return prompts
