"""Beam-search rollouts constrained to a catalog (MiniOneRec's generative recommendation): each prompt's group is
its `n` beams, distinct responses best first (a response's place in its group is its beam rank), found by
transformers' beam search with no sampling and no length penalty, so that a beam's score is the sum of its
tokens' log-probs under the full softmax (MiniOneRec's): nothing of the model folder's generation_config.json
(a repetition penalty, sampling settings) takes part (hf.py gives the engine's copy a neutral one). With a
catalog every response is one of its items followed by one end token (item_end): a prefix tree over the items' token ids allows, at each step, only the tokens that
continue some item. The trainer's log-probs of the beams are those of the unconstrained softmax, as MiniOneRec
trains (rollout and update agree: neither renormalizes over the allowed tokens).

`actor_rollout_ref.rollout.catalog_file`: a JSON index (MiniOneRec's `*.index.json`: item id -> its code tokens,
an item being their concatenation) or a text file, one item a line.
"""

from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

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


def allowed_tokens(tree: dict[tuple[int, ...], list[int]], prompt_width: int, end_ids: Sequence[int]) -> Callable[[int, torch.Tensor], list[int]]:
    """transformers' prefix_allowed_tokens_fn: a beam's next tokens given its ids (prompt_width prompt tokens, then
    what it generated); a finished beam (past an end token) may only end again."""
    ends = list(end_ids)

    def allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
        return tree.get(tuple(ids[prompt_width:].tolist()), ends)

    return allowed


@torch.no_grad()
def beam_search(model: PreTrainedModel, prompts: Sequence[list[int]], n: int, max_new_tokens: int, end_ids: Sequence[int], pad_id: int,
                tree: dict[tuple[int, ...], list[int]] | None, batch_size: int) -> list[tuple[list[int], list[int], bool]]:
    """For each prompt, its `n` beams best first: (prompt ids, response ids through the first end token,
    truncated); batch_size // n prompts a search, left-padded to one width, so that every beam's generated tokens
    start at the same place."""
    results = []
    config = GenerationConfig(num_beams=n, num_return_sequences=n, do_sample=False, length_penalty=0.0, early_stopping=True,
                              max_new_tokens=max_new_tokens, eos_token_id=list(end_ids), pad_token_id=pad_id)
    per_search = max(batch_size // n, 1)
    for first in range(0, len(prompts), per_search):
        batch = prompts[first : first + per_search]
        width = max(len(prompt) for prompt in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in batch], device=model.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        constraint = allowed_tokens(tree, width, end_ids) if tree is not None else None
        output = model.generate(input_ids, attention_mask=attention_mask, generation_config=config, prefix_allowed_tokens_fn=constraint)
        for row, ids in enumerate(output[:, width:].tolist()):
            end = next((i for i, token in enumerate(ids) if token in end_ids), None)
            results.append((list(batch[row // n]), ids if end is None else ids[: end + 1], end is None))
    return results
