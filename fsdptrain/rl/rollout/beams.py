"""Catalogs for MiniOneRec's generative recommendation: beam-search rollouts where each prompt's group is its `n`
beams, distinct responses best first (a response's place in its group is its beam rank), found by transformers'
beam search rule with no sampling and no length penalty (hf.py's beam_search), so that a beam's score is the sum
of its tokens' log-probs under the full softmax (MiniOneRec's): nothing of the model folder's
generation_config.json (a repetition penalty, sampling settings) takes part. With a catalog every response, beam
or sample, is one of its items followed by one end token (item_end): a prefix tree over the items' token ids
allows, at each step, only the tokens that continue some item. The trainer's log-probs of the beams are those of the unconstrained softmax, as MiniOneRec
trains (rollout and update agree: neither renormalizes over the allowed tokens).

`actor_rollout_ref.rollout.catalog_file`: a JSON index (MiniOneRec's `*.index.json`: item id -> its code tokens,
an item being their concatenation) or a text file, one item a line.
"""

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from fsdptrain.errors import ConfigError
from fsdptrain.models.added_tokens import read_item_index, read_lines


def read_catalog(path: str, key: str) -> list[str]:
    """The items of a catalog file, in its order, each once."""
    items = ["".join(tokens) for tokens in read_item_index(path, key).values()] if path.endswith(".json") else read_lines(path, key)
    if not items:
        raise ConfigError(f"{key}={path!r} holds no items")
    return list(dict.fromkeys(items))


def item_end(tokenizer: PreTrainedTokenizerBase, end_ids: Sequence[int]) -> int:
    """The one token that ends an item: the tokenizer's end of sequence where the model ends with it (an instruct
    model's end of turn, which its fine-tuning targets close with), else the model's first end token. One only, or
    an item could end two ways and fill two beams."""
    return tokenizer.eos_token_id if tokenizer.eos_token_id in end_ids else end_ids[0]


def catalog_tree(items: Sequence[str], tokenizer: PreTrainedTokenizerBase, end_id: int) -> dict[tuple[int, ...], list[int]]:
    """Each prefix of an item's token ids (the empty one included) -> the tokens that may follow it; a whole item
    is followed by `end_id` alone."""
    tree: dict[tuple[int, ...], set[int]] = {}
    for item in items:
        ids = tuple(tokenizer(item, add_special_tokens=False)["input_ids"])
        for length in range(len(ids)):
            tree.setdefault(ids[:length], set()).add(ids[length])
        tree.setdefault(ids, set()).add(end_id)
    return {prefix: sorted(tokens) for prefix, tokens in tree.items()}
