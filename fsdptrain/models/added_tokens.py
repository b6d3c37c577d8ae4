"""Tokens added to a pretrained model (MiniOneRec's semantic IDs, `<a_42><b_80><c_160>`), and `freeze_llm`: only
their rows train.

`model.added_tokens_file` names the tokens: a JSON index (MiniOneRec's `*.index.json`: item id -> its code tokens)
or a text file, one token a line. The tokenizer gains the distinct ones not yet in its vocabulary, sorted as
strings, as ordinary tokens (MiniOneRec's `add_tokens`); it is saved with every checkpoint and export, so a run
from that export (GRPO after SFT) finds them there and adds nothing. The input embedding (and an untied output
layer) grows before sharding to hold every token id; a newly added token's row is drawn as transformers'
`mean_resizing` draws it (`added_tokens_init: mean`): the old tokens' mean row plus noise of 1e-9 times their
covariance, from a generator of the run's seed so that every model built for the run (and every rank) draws the
same rows. Those rows are all but equal, so the model tells the new tokens apart only as far as training has moved
them; `added_tokens_init: pieces` makes each new row the mean of the rows of the pieces that the tokenizer split
the token's text into before it was added (`<a_3>`: `<`, `a`, `_`, `3`, `>`), so that `<a_3>` and `<a_4>` differ
from the start, as a pretrained model's digits do.

`freeze_llm`: every parameter is frozen but the input embedding and the output layer, of which only the rows of
the file's tokens train: by their ids, whatever the row count (a padded matrix holds rows past the tokenizer).
Their other rows' gradients are zeroed before clipping (the gradient norm is the trained rows') and their values
restored after each optimizer step, so weight decay never reaches them: they stay the pretrained rows bit for bit.
"""

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from fsdptrain.config.shared import LanguageModelConfig
from fsdptrain.distributed.fsdp import local_shard
from fsdptrain.errors import ConfigError

MEAN_RESIZING_SCALE = 1e-9  # transformers' epsilon on the old rows' covariance


def read_item_index(path: str, key: str) -> dict[str, list[str]]:
    """MiniOneRec's `*.index.json`: each item id -> its code tokens."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r} does not exist")
    try:
        with open(path) as f:
            index = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}={path!r} is not valid JSON: {e}") from e
    if not isinstance(index, dict) or not all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in index.values()):
        raise ConfigError(f"{key}={path!r} must map each item to its list of tokens, as MiniOneRec's *.index.json")
    return index


def read_lines(path: str, key: str) -> list[str]:
    """The non-blank lines of a text file, stripped."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}={path!r} does not exist")
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def read_added_tokens(path: str, key: str) -> list[str]:
    """The distinct tokens of `path` (a JSON index of item -> tokens, or one token a line), sorted as strings."""
    if path.endswith(".json"):
        tokens = {token for item_tokens in read_item_index(path, key).values() for token in item_tokens}
    else:
        tokens = set(read_lines(path, key))
    if not tokens:
        raise ConfigError(f"{key}={path!r} holds no tokens")
    return sorted(tokens)


@dataclass(frozen=True)
class AddedTokens:
    pretrained_rows: int  # the folder's token matrices' rows
    old_tokens: int  # the tokenizer's size before
    new_ids: list[int]  # tokens added now: their rows are drawn
    ids: list[int]  # every token of the file: the rows freeze_llm trains
    pieces: list[list[int]] | None  # added_tokens_init=pieces: each new token's text as old token ids; None: mean_resizing


def add_model_tokens(model: LanguageModelConfig, key: str, tokenizer: PreTrainedTokenizerBase,
                     hf_config: PretrainedConfig) -> AddedTokens | None:
    """The tokens of `model.added_tokens_file` (`key`: its section) added to `tokenizer`, and `hf_config`'s (its
    decoder's) vocab_size raised to hold every token id; None without the key."""
    if not model.added_tokens_file:
        return None
    tokens = read_added_tokens(model.added_tokens_file, f"{key}.added_tokens_file")
    text_config = hf_config.get_text_config()  # a vision-language model's token matrices are its decoder's
    old_tokens, pretrained_rows = len(tokenizer), text_config.vocab_size
    new = [token for token in tokens if token not in tokenizer.get_vocab()]
    pieces = [tokenizer(token, add_special_tokens=False)["input_ids"] for token in new] if model.added_tokens_init == "pieces" else None
    tokenizer.add_tokens(new)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    text_config.vocab_size = max(pretrained_rows, len(tokenizer))
    return AddedTokens(pretrained_rows, old_tokens, tokenizer.convert_tokens_to_ids(new), ids, pieces)


def output_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The token matrices: the input embedding's weight and, where untied, the output layer's."""
    matrices = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight is not matrices[0]:
        matrices.append(output.weight)
    return matrices


@torch.no_grad()
def grow_embeddings(model: PreTrainedModel, rows: int, added: AddedTokens, seed: int) -> None:
    """`model`'s token matrices grown to `rows` (if fewer), and the rows of the `added` tokens that are new drawn
    from the old rows' mean and covariance (transformers' mean_resizing), or the mean of their pieces' rows."""
    if model.get_input_embeddings().weight.shape[0] < rows:
        model.resize_token_embeddings(rows, mean_resizing=False)
    new_ids, old_tokens = added.new_ids, added.old_tokens
    if added.pieces is not None:
        for matrix in output_matrices(model):
            for token, pieces in zip(new_ids, added.pieces):
                matrix[token] = matrix[pieces].float().mean(0).to(matrix.dtype)
        return
    generator = torch.Generator().manual_seed(seed)
    for matrix in output_matrices(model):
        old = matrix[:old_tokens].float()
        mean = old.mean(0)
        centered = old - mean
        covariance = MEAN_RESIZING_SCALE * centered.T @ centered / old_tokens
        try:
            factor = torch.linalg.cholesky(covariance)
        except torch.linalg.LinAlgError:  # not positive definite: the mean alone, as transformers falls back to
            factor = torch.zeros_like(covariance)
        noise = torch.randn(len(new_ids), mean.numel(), generator=generator) @ factor.T
        matrix[new_ids] = (mean + noise).to(matrix.dtype)


def freeze_all_but_token_matrices(model: nn.Module) -> None:
    """freeze_llm, before sharding: the token matrices alone keep their gradients (TrainedRows narrows them)."""
    model.requires_grad_(False)
    for matrix in output_matrices(model):
        matrix.requires_grad_(True)


class TrainedRows:
    """freeze_llm on a sharded model (frozen by freeze_all_but_token_matrices): only the rows of `ids` of its
    token matrices train."""

    def __init__(self, model: nn.Module, ids: list[int]):
        self.rows = []  # (parameter, this rank's mask of trained rows, this rank's frozen values)
        for matrix in output_matrices(model):
            trained = torch.zeros(matrix.shape[0], 1, dtype=torch.bool)
            trained[ids] = True
            if isinstance(matrix, DTensor):
                trained = distribute_tensor(trained.to(matrix.device_mesh.device_type), matrix.device_mesh, matrix.placements)
            mask = local_shard(trained).to(local_shard(matrix).device)
            self.rows.append((matrix, mask, local_shard(matrix).detach().clone()))

    def mask_gradients(self) -> None:
        """Before clipping: the frozen rows' gradients zeroed."""
        for matrix, mask, _ in self.rows:
            if matrix.grad is not None:
                local_shard(matrix.grad).mul_(mask)

    @torch.no_grad()
    def restore_frozen(self) -> None:
        """After the optimizer step: the frozen rows as they were (weight decay moved them)."""
        for matrix, mask, frozen in self.rows:
            values = local_shard(matrix)
            values.copy_(torch.where(mask, values, frozen))
