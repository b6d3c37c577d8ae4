"""Rollouts on every rank from a plain (unsharded) transformers copy of the policy that the trainer refreshes after
each update: transformers' model, cache and sampling processors, driven by decoding loops of our own (prompts
prefilled once for their n responses or beams, one uniform a sampled token, ended responses no longer forwarded;
with a catalog, every response one of its items). Runs wherever transformers runs."""

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fsdptrain.data.images import Images
from fsdptrain.distributed.offload import HostCopies, release_cached
from fsdptrain.models.architecture import read_architecture
from fsdptrain.models.attention import GROUPED_ATTENTION
from fsdptrain.models.vision import IMAGE_INPUTS, attention_setting, image_placeholder_ids, model_class
from fsdptrain.rl.rollout.base import ROLLOUT_ENGINES, EngineInfo, EngineSpec, Generation
from fsdptrain.rl.rollout.beams import catalog_tree, item_end, read_catalog


def end_token_ids(model: PreTrainedModel, fallback: int) -> list[int]:
    eos = model.generation_config.eos_token_id
    return sorted(eos if isinstance(eos, list) else [eos] if eos is not None else [fallback])


def cache_keyword(model: PreTrainedModel) -> str:
    """The name of the forward's key/value cache argument and output: `cache` from transformers 5.24 (where the
    older `past_key_values` still works but warns), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def group_batches(prompts: Sequence[list[int]], n: int, batch_size: int) -> Iterator[tuple[Sequence[list[int]], int]]:
    """(prompts, copies of each) batches of at most `batch_size` sequences (or `n` where n > batch_size) in the order
    of n responses to each prompt in a row: whole groups together, so that each prompt is prefilled once."""
    per_batch, copies = max(1, batch_size // n), min(n, batch_size)
    for first in range(0, len(prompts), per_batch):
        for done in range(0, n, copies):
            yield prompts[first : first + per_batch], min(copies, n - done)


def warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """transformers' own temperature, top-k and top-p processors, in generate's order: the distribution that a
    response is sampled from and that its log-probs are of."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors


def draw(scores: torch.Tensor, do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token from softmax(scores), sampled or greedy, and its log-probability. Sampling inverts the
    cumulative distribution with one uniform a row: torch.multinomial, which generate uses, draws an exponential
    for every entry of the vocabulary, several times the cost of the rest of the draw on a CPU."""
    top = scores.max(-1, keepdim=True).values
    weights = (scores - top).exp()
    if do_sample:  # right=True: the first token whose cumulative mass exceeds the uniform; a zero-mass token never is
        cumulative = weights.cumsum(-1)
        uniform = torch.rand_like(top) * cumulative[:, -1:]
        tokens = torch.searchsorted(cumulative, uniform, right=True).clamp_(max=scores.shape[-1] - 1)
    else:
        tokens = scores.argmax(-1, keepdim=True)
    # the normalizer from a sum, not from the running sum's end, which drifts by ~1e-4 over a large vocabulary
    return tokens.squeeze(1), (scores.gather(1, tokens) - top - weights.sum(-1, keepdim=True).log()).squeeze(1)


def constrained_draw(logits: torch.Tensor, done: torch.Tensor, tree: dict[tuple[int, ...], list[int]], end_ids: list[int],
                     warp: LogitsProcessorList, do_sample: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` among the tokens that continue a catalog item after each row's `done` tokens (the prefix tree of
    rollout/beams.py, applied before the sampling processors, as generate's prefix constraint is), with each drawn
    token's log-prob as the trainer computes it: the softmax at `temperature` over the whole vocabulary, not
    renormalized over the allowed tokens (MiniOneRec's choice; rollout/beams.py) nor over top-k / top-p."""
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for row, prefix in enumerate(done.tolist()):
        allowed[row, tree.get(tuple(prefix), end_ids)] = True
    tokens, _ = draw(warp(None, logits.masked_fill(~allowed, float("-inf"))), do_sample)
    return tokens, (logits / temperature).log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)


@dataclass
class WeightsRefresh:
    """Partial rollouts (standalone rollout ranks): `load` loads the policy's newer weights where they have come
    and returns their version (None: none came); the responses being decoded go on under them, their keys and
    values recomputed, each token tagged with the version that drew it."""

    load: Callable[[], int | None]
    version: int  # the weights' version now


@dataclass
class Decoded:
    """Each row's tokens, their log-probs and the versions that drew them, each (rows, width), valid through the
    row's `drawn` count (pad after it), and the rows that were still going when decoding stopped early."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    versions: torch.Tensor
    drawn: torch.Tensor
    unfinished: list[int]


@torch.no_grad()
def decode(model: PreTrainedModel, cache: Cache, logits: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
           max_new_tokens: int, end_ids: list[int], pad_id: int, warp: LogitsProcessorList, do_sample: bool,
           tree: dict[tuple[int, ...], list[int]] | None = None, temperature: float = 1.0,
           refresh: WeightsRefresh | None = None, prompts: Sequence[list[int]] = (), budgets: torch.Tensor | None = None,
           enough: Callable[[list[int]], bool] | None = None, version: int = 0, images: Sequence[Images | None] | None = None,
           placeholder_ids: Sequence[int] = ()) -> Decoded:
    """Responses decoded from each row's next-token `logits` and next position (`positions`) after its left-padded
    prompt (`prompts` and their `images`, one a row, with `refresh`), whose keys and values `cache` holds; with a catalog's prefix `tree`, every response is one of
    its items. A row ends at its first end token or after its budget of tokens (`budgets`, a row's; else
    max_new_tokens each); only the rows still going are forwarded, their cache entries selected as the others end.
    Each token is tagged with the policy version that drew it: `version`, or with `refresh` the weights' version
    then, newer weights being taken between two tokens. `enough(rows still going)` may stop decoding after any
    token (colocate_async's pool). A row that draws one of `placeholder_ids` (a vision-language model's image
    tokens, which its forward would take for an image's place) ends before it, as a response cut short."""
    rows, device = logits.shape[0], logits.device
    tokens = torch.full((rows, max_new_tokens), pad_id, device=device)
    log_probs = torch.zeros(rows, max_new_tokens, device=device)
    versions = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=device)
    drawn = torch.zeros(rows, dtype=torch.long, device=device)
    budgets = torch.full((rows,), max_new_tokens, device=device) if budgets is None else budgets.to(device)
    live = torch.arange(rows, device=device)
    ends, placeholders = torch.tensor(end_ids, device=device), torch.tensor(list(placeholder_ids), dtype=torch.long, device=device)
    keyword = cache_keyword(model)
    version = refresh.version if refresh is not None else version
    for step in range(max_new_tokens):
        if tree is None:
            chosen, chosen_log_probs = draw(warp(None, logits.float()), do_sample)
        else:
            chosen, chosen_log_probs = constrained_draw(logits.float(), tokens[live, :step], tree, end_ids, warp, do_sample, temperature)
        tokens[live, step], log_probs[live, step] = chosen, chosen_log_probs
        written = ~torch.isin(chosen, placeholders)
        drawn[live] += written
        versions[live, step] = version
        going = ~torch.isin(chosen, ends) & (budgets[live] > step + 1) & written
        if step == max_new_tokens - 1 or not going.any():
            live = live[:0]
            break
        if not going.all():
            keep = going.nonzero().squeeze(1)
            live, chosen, attention_mask, positions = live[keep], chosen[keep], attention_mask[keep], positions[keep]
            cache.reorder_cache(keep)
        if enough is not None and enough(live.tolist()):
            break
        if refresh is not None and (newer := refresh.load()) is not None:  # the live rows so far, prefilled under the new weights
            version = refresh.version = newer
            cache, logits, attention_mask, positions = prefill(model, [list(prompts[row]) + tokens[row, : step + 1].tolist() for row in live.tolist()],
                                                               pad_id, [images[row] for row in live.tolist()] if images else None)
            continue
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(live), 1)], dim=1)
        logits = model(input_ids=chosen[:, None], attention_mask=attention_mask, position_ids=positions[:, None], use_cache=True,
                       **{keyword: cache}).logits[:, -1]
        positions = positions + 1
    return Decoded(tokens, log_probs, versions, drawn, live.tolist())


def common_prefix_length(prompts: Sequence[list[int]]) -> int:
    """The tokens every prompt begins with, short of the shortest prompt's last: each keeps a token to prefill."""
    shortest = min(map(len, prompts))
    for length, tokens in enumerate(zip(*(ids[: shortest - 1] for ids in prompts))):
        if any(token != tokens[0] for token in tokens):
            return length
    return shortest - 1


def prefill(model: PreTrainedModel, prompts: Sequence[list[int]], pad_id: int, images: Sequence[Images | None] | None = None,
            share_prefix: bool = False) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key/value cache of `prompts` left-padded to one width, each one's next-token logits, the attention mask,
    and each one's next position (a vision-language model's prompt `images` with their 3-D positions; a text
    token's position is one past the largest before it).

    With `share_prefix` (a model whose every layer attends to all earlier keys: Architecture.shares_batch_prefix)
    the prefix that all of a text batch's prompts begin with (a chat template's opening, a system prompt, a shared
    instruction) is forwarded once and its keys and values copied to every row; the rest of each prompt follows it,
    padded between the two, masked there and positioned after the prefix: the same cache as each prompt's own.

    The cache's rows are chosen (repeated, selected) by `reorder_cache`, which every cache layer has, those with a
    recurrent state (linear attention) included; batch_select_indices and batch_repeat_interleave are key/value
    layers' only."""
    keyword, device = cache_keyword(model), model.device
    with_images = images is not None and any(i is not None for i in images)
    shared = common_prefix_length(prompts) if share_prefix and len(prompts) > 1 and not with_images else 0
    rests = [ids[shared:] for ids in prompts]
    width = max(map(len, rests))
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in rests], device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rests], device=device)
    extra = {}
    if with_images:
        positions = torch.zeros(3, len(prompts), width, dtype=torch.long)
        for row, (ids, image) in enumerate(zip(prompts, images)):
            positions[:, row, width - len(ids) :] = image.positions_through(len(ids)) if image is not None else torch.arange(len(ids))
        positions = positions.to(device)
        following = positions.amax(dim=(0, 2)) + 1
        extra = {name: torch.cat([i.inputs[name] for i in images if i is not None]).to(device) for name in IMAGE_INPUTS}
    else:
        positions = shared + (attention_mask.cumsum(-1) - 1).clamp(min=0)
        following = shared + attention_mask.sum(-1)
    if shared:
        prefix = torch.tensor([prompts[0][:shared]], device=device)
        extra[keyword] = model(input_ids=prefix, position_ids=torch.arange(shared, device=device)[None], use_cache=True)[keyword]
        extra[keyword].reorder_cache(torch.zeros(len(prompts), dtype=torch.long, device=device))
        attention_mask = torch.cat([attention_mask.new_ones(len(prompts), shared), attention_mask], dim=1)
    # the last position as an index tensor, not logits_to_keep=1: its slice of the hidden states is not contiguous,
    # and torch.matmul then copies the output layer's weight once per row of the batch
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                   logits_to_keep=torch.tensor([width - 1], device=device), **extra)
    return output[keyword], output.logits[:, -1], attention_mask, following


@torch.no_grad()
def generate(
    model: PreTrainedModel, prompts: Sequence[list[int]], n: int, max_new_tokens: int, batch_size: int, end_ids: list[int],
    pad_id: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, do_sample: bool = True,
    calculate_log_probs: bool = False, tree: dict[tuple[int, ...], list[int]] | None = None, refresh: WeightsRefresh | None = None,
    images: Sequence[Images | None] | None = None, placeholder_ids: Sequence[int] = (), share_prefix: bool = False,
) -> list[Generation]:
    """`n` responses to each prompt (n in a row), in left-padded batches. Each distinct prompt of a batch is
    prefilled once and its key/value cache copied to its responses: on a CPU, prefilling n copies of a prompt costs
    more than decoding the answers. Sampling follows the rollout's temperature, top-k and top-p only (not the
    model's generation_config), the distribution whose log-probs the trainer computes. With `refresh` (partial
    rollouts), each response token carries the version of the weights that drew it. A vision-language model's
    prompt `images` (one a prompt, None for a text prompt) are prefilled with their prompts. `share_prefix`: a
    batch's common prompt prefix is prefilled once (`prefill`). Prompts that fill more than one batch are batched
    in the order of their lengths, then of their tokens: a batch pads its prompts to its longest and shares the
    prefix they all begin with; the responses come back in the prompts' order."""
    warp = warpers(temperature, top_k, top_p) if do_sample else LogitsProcessorList()
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), list(prompts[i]))) if len(prompts) * n > batch_size else range(len(prompts))
    images = images or [None] * len(prompts)
    generations = []
    for distinct, copies in group_batches([(prompts[i], images[i]) for i in order], n, batch_size):
        distinct_ids, distinct_images = [ids for ids, _ in distinct], [image for _, image in distinct]
        cache, logits, attention_mask, positions = prefill(model, distinct_ids, pad_id, distinct_images, share_prefix)
        cache.reorder_cache(torch.arange(len(distinct), device=logits.device).repeat_interleave(copies))
        batch = [ids for ids in distinct_ids for _ in range(copies)]
        decoded = decode(model, cache, logits.repeat_interleave(copies, 0), attention_mask.repeat_interleave(copies, 0),
                         positions.repeat_interleave(copies, 0), max_new_tokens, end_ids, pad_id, warp, do_sample, tree, temperature, refresh,
                         batch, images=[image for image in distinct_images for _ in range(copies)], placeholder_ids=placeholder_ids)
        for row, kept in enumerate(decoded.drawn.tolist()):
            ids = decoded.tokens[row, :kept].tolist()
            sampled = decoded.log_probs[row, :kept].tolist() if calculate_log_probs else None
            drawn_by = decoded.versions[row, :kept].tolist() if refresh is not None else None
            generations.append(Generation(batch[row], ids, [1] * kept, sampled, not ids or ids[-1] not in end_ids, versions=drawn_by))
    in_order = [None] * len(generations)
    for place, prompt in enumerate(order):
        in_order[prompt * n : (prompt + 1) * n] = generations[place * n : (place + 1) * n]
    return in_order


@torch.no_grad()
def beam_search(model: PreTrainedModel, prompts: Sequence[list[int]], n: int, max_new_tokens: int, end_ids: list[int], pad_id: int,
                tree: dict[tuple[int, ...], list[int]] | None, batch_size: int, share_prefix: bool = False,
                images: Sequence[Images | None] | None = None, placeholder_ids: Sequence[int] = ()) -> list[Generation]:
    """Each prompt's `n` beams, best first, through the first end token: transformers' beam search (no sampling, no
    length penalty, early stopping; a beam's score the sum of its tokens' log-probs under the full softmax) with a
    catalog's prefix `tree` as its prefix constraint, in batches of batch_size // n prompts. Our own loop over
    transformers' model and cache because generate forwards each prompt once per beam: at 10 beams and 80-token
    prompts that is nine tenths of an evaluation's compute. `share_prefix` as `prefill`'s; a vision-language
    model's prompt `images` are prefilled with their prompts, and no beam takes one of `placeholder_ids` (its image
    tokens: transformers' `bad_words_ids`)."""
    generations = []
    per_search = max(batch_size // n, 1)
    for first in range(0, len(prompts), per_search):
        batch = prompts[first : first + per_search]
        batch_images = images[first : first + per_search] if images else None
        cache, logits, attention_mask, positions = prefill(model, batch, pad_id, batch_images, share_prefix=share_prefix)
        cache.reorder_cache(torch.arange(len(batch), device=logits.device).repeat_interleave(n))
        tokens, finished = search_beams(model, cache, logits.repeat_interleave(n, 0), attention_mask.repeat_interleave(n, 0),
                                        positions.repeat_interleave(n, 0), n, max_new_tokens, end_ids, pad_id, tree, placeholder_ids)
        for row, ids in enumerate(tokens.view(len(batch) * n, -1).tolist()):
            end = next((i for i, token in enumerate(ids) if token in end_ids), None)
            response = ids if end is None else ids[: end + 1]
            generations.append(Generation(list(batch[row // n]), response, [1] * len(response), None, end is None or not finished.view(-1)[row]))
    return generations


def search_beams(model: PreTrainedModel, cache: Cache, logits: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, n: int,
                 max_new_tokens: int, end_ids: list[int], pad_id: int, tree: dict[tuple[int, ...], list[int]] | None,
                 banned_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (prompts, n, max_new_tokens), finished (prompts, n)): the `n` finished beams of each prompt, best
    first, from `n` copies of its next-token `logits` and cache. transformers' rule, step by step: the top
    (1 + end tokens) x n continuations of all beams; those among the first n that end (an end token, or the length
    limit) join the finished beams if they beat the worst there; the n best that do not end go on; a prompt is done
    when its n finished beams all score above every running one, the search when every prompt is. One departure:
    where fewer than n continuations are allowed, transformers fills the beams with copies scored -1e9 that end
    as second copies of items; here an impossible beam scores -inf and is never finished, so no item comes twice
    (a prompt with fewer than n items within reach gets fewer finished beams). No beam takes a `banned_ids` token."""
    rows, vocab, device = logits.shape[0], logits.shape[-1], logits.device
    prompts, keep, never = rows // n, max(2, 1 + len(end_ids)) * n, float("-inf")
    ends = torch.tensor(end_ids, device=device)
    running = torch.full((prompts, n, 0), pad_id, dtype=torch.long, device=device)
    running_scores = torch.full((prompts, n), never, device=device)
    running_scores[:, 0] = 0.0  # the n copies are one beam until they differ
    done_tokens = torch.full((prompts, n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done_scores = torch.full((prompts, n), never, device=device)
    done = torch.zeros((prompts, n), dtype=torch.bool, device=device)
    improvable = torch.ones((prompts, 1), dtype=torch.bool, device=device)
    keyword = cache_keyword(model)
    banned = torch.tensor(list(banned_ids), dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        log_probs = logits.float().log_softmax(-1).index_fill(1, banned, never)
        if tree is not None:
            allowed = torch.zeros_like(log_probs, dtype=torch.bool)
            for row, prefix in enumerate(running.view(rows, step).tolist()):
                allowed[row, tree.get(tuple(prefix), end_ids)] = True
            log_probs = log_probs.masked_fill(~allowed, never)
        totals = (log_probs.view(prompts, n, vocab) + running_scores[:, :, None]).view(prompts, n * vocab)
        top_scores, top = totals.topk(keep, dim=1)
        source, token = top // vocab, top % vocab
        candidates = torch.cat([running.gather(1, source[:, :, None].expand(-1, -1, step)), token[:, :, None]], dim=2)
        ending = torch.isin(token, ends) | (step == max_new_tokens - 1)
        # the finished: the ending among the first n, while the prompt's finished are not all in and may improve
        entering = ending & (torch.arange(keep, device=device) < n) & ~done.all(1, keepdim=True) & improvable & top_scores.isfinite()
        merged_scores = torch.cat([done_scores, top_scores.masked_fill(~entering, never)], dim=1)
        merged_tokens = torch.cat([done_tokens, pad_right(candidates, max_new_tokens, pad_id)], dim=1)
        merged_done = torch.cat([done, entering], dim=1)
        best = merged_scores.topk(n, dim=1).indices
        done_scores, done = merged_scores.gather(1, best), merged_done.gather(1, best)
        done_tokens = merged_tokens.gather(1, best[:, :, None].expand(-1, -1, max_new_tokens))
        # the running: the n best that do not end (transformers keeps an ended one at -1e9 where fewer go on, to
        # end again later as a second copy of its item)
        going_scores = top_scores.masked_fill(ending, never)
        going = going_scores.topk(n, dim=1).indices
        running_scores = going_scores.gather(1, going)
        running = candidates.gather(1, going[:, :, None].expand(-1, -1, step + 1))
        worst_done = torch.where(done, done_scores.min(1, keepdim=True).values, never)
        improvable = improvable & (running_scores[:, :1] > worst_done).any(1, keepdim=True)
        if step == max_new_tokens - 1 or not improvable.any() or done.all() or ending.all():
            break
        beams = (source.gather(1, going) + torch.arange(prompts, device=device)[:, None] * n).view(rows)
        cache.reorder_cache(beams)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        logits = model(input_ids=running[:, :, -1].reshape(rows, 1), attention_mask=attention_mask, position_ids=positions[:, None],
                       use_cache=True, **{keyword: cache}).logits[:, -1]
        positions = positions + 1
    return done_tokens, done


def pad_right(tokens: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    """`tokens` (..., length) padded on the right with `pad_id` to `width`."""
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[-1]), value=pad_id)


class HFRollout:
    """The policy's rollout engine: a plain copy of the model on this rank's device, in `dtype`."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype | str, pad_id: int, trust_remote_code: bool = False,
                 free_cache_engine: bool = True, beams: bool = False, catalog_file: str | None = None, enable_prefix_caching: bool = True):
        # SDPA on accelerators where transformers implements the model with it (gpt-oss's sinks it does not)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        architecture = read_architecture(config)
        attention = "sdpa" if device.type != "cpu" and architecture.supports_sdpa else GROUPED_ATTENTION
        self.model = model_class(config, AutoModelForCausalLM).from_pretrained(path, dtype=dtype, attn_implementation=attention_setting(config, attention),
                                                                              trust_remote_code=trust_remote_code)
        self.model.requires_grad_(False).eval().to(device)
        self.device, self.dtype, self.pad_id = device, self.model.dtype, pad_id
        self.group = None  # every rank runs its own copy
        self.end_ids = end_token_ids(self.model, pad_id)
        self.placeholder_ids = image_placeholder_ids(config)
        # What decides a response is what the rollout asks for: the folder's generation_config.json (a repetition
        # penalty, sampling settings) would otherwise fill in whatever a call leaves at transformers' defaults.
        self.model.generation_config = GenerationConfig(eos_token_id=self.end_ids, pad_token_id=pad_id)
        self.sleeps = free_cache_engine and device.type == "cuda"  # on CPU there is nothing to free
        self.parked = HostCopies()  # the weights' bytes while asleep
        self.beams = beams  # rollout.beam_search: each prompt's n responses are its n beams (rollout/beams.py)
        self.catalog = None
        self.refresh: WeightsRefresh | None = None  # partial rollouts: newer weights taken between two tokens
        self.share_prefix = enable_prefix_caching and architecture.shares_batch_prefix  # prefill a batch's common prefix once
        if catalog_file:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.catalog = catalog_tree(read_catalog(catalog_file, "actor_rollout_ref.rollout.catalog_file"), tokenizer,
                                        item_end(tokenizer, self.end_ids))

    def generate(self, prompts: Sequence[list[int]], *, n: int, max_new_tokens: int, batch_size: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, calculate_log_probs: bool = False,
                 images: Sequence[Images | None] | None = None) -> list[Generation]:
        if self.beams:
            return beam_search(self.model, prompts, n, max_new_tokens, self.end_ids, self.pad_id, self.catalog, batch_size, self.share_prefix,
                               images, self.placeholder_ids)
        return generate(self.model, prompts, n, max_new_tokens, batch_size, self.end_ids, self.pad_id, temperature, top_p, top_k, do_sample,
                        calculate_log_probs, self.catalog, self.refresh, images, self.placeholder_ids, self.share_prefix)

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        parameters = dict(self.model.named_parameters())
        for name, tensor in weights:
            parameters[name].copy_(tensor)

    def shutdown(self) -> None:
        self.model = None  # the copy of the policy, freed before the job's teardown

    @torch.no_grad()
    def sleep(self) -> None:
        """Free the accelerator for training: the weights' bytes wait in pinned host buffers, made once and reused
        (distributed/offload.py's parking)."""
        if not self.sleeps or self.parked.away:
            return
        self.parked.park(self._tensors())
        release_cached()

    @torch.no_grad()
    def wake_up(self) -> None:
        if self.parked.away:
            self.parked.restore(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        """Every parameter (a tied one once) and buffer of the copy."""
        return [*self.model.parameters(), *self.model.buffers()]


@dataclass(frozen=True)
class HFSettings:
    """The hf engine's own settings (actor_rollout_ref.rollout.*)."""

    beam_search: bool = False  # a prompt's n responses are its n beams (rollout/beams.py)
    catalog_file: str | None = None  # responses constrained to its items
    enable_prefix_caching: bool = True  # a batch's common prompt prefix prefilled once (where the architecture allows)


@ROLLOUT_ENGINES.register("hf", info=EngineInfo(HFSettings, beams=True, constrained=True, images=True))
def build_hf_rollout(spec: EngineSpec) -> HFRollout:
    settings: HFSettings = spec.settings
    return HFRollout(spec.path, spec.device, spec.dtype, spec.pad_id, spec.trust_remote_code, spec.free_cache_engine, settings.beam_search,
                     settings.catalog_file, settings.enable_prefix_caching)
