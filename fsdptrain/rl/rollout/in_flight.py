"""colocate_async (verl 0.9's colocated asynchronous trainer) on the hf engine: every rank generates and trains, and
keeps the responses it has started in a pool across steps. A step decodes the pool until this rank's share of a
batch of groups is complete, trains on the oldest complete groups, and leaves the rest in flight: after the update
they go on under the new weights, their prompts and tokens so far prefilled again (as partial rollouts are), the
tokens drawn before keeping the version and the sampling log-probs that drew them. The pool holds the prompt
batches of the next `lead` steps (num_warmup_batches) as well, so that a long response goes on while later steps
train on the groups that finished. With max_off_policy_strategy=wait, a step trains its own batch's groups instead,
waiting for them while later batches' go on beside them, and no more batches are in flight than keep every group
within max_off_policy_threshold: none is dropped.

The pool decodes its live responses oldest first, as many at once as the sync mode's batches hold (whole groups, at
most the rollout's batch size: log_prob_micro_batch_size_per_gpu), each distinct prompt prefilled once; when fewer
than half go on and others wait, the live ones stop, and go on with the waiting ones joined (their prompts and tokens
prefilled again). With nothing in flight (lead 0) and a batch that holds the rank's share, a step draws what the
sync mode draws, with the same random numbers."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList

from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import gather_lists
from fsdptrain.errors import ConfigError
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation
from fsdptrain.rl.rollout.hf import HFRollout, decode, prefill, warpers


@dataclass
class Response:
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the policy version that drew each token
    finished: bool = False


@dataclass
class InFlightGroup:
    prompt: Prompt
    batch: int  # the prompt batch it was drawn in
    index: int  # its place in this rank's share of that batch
    responses: list[Response]

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)

    @property
    def oldest_version(self) -> int:
        return min(v for r in self.responses for v in r.versions)

    def generations(self, end_ids: list[int], with_log_probs: bool) -> list[Generation]:
        return [Generation(self.prompt.ids, r.tokens, [1] * len(r.tokens), r.log_probs if with_log_probs else None,
                           not r.tokens or r.tokens[-1] not in end_ids, versions=r.versions, images=self.prompt.images) for r in self.responses]


@dataclass
class ResponsePool:
    """One rank's responses in flight (colocate_async), by prompt group, oldest first; `taken`: for each batch
    added and not yet wholly taken, the groups already trained (or dropped), which is what a checkpoint keeps."""

    parallel: Parallel
    n: int  # responses to a prompt
    lead: int  # prompt batches in flight ahead of the one a step draws (num_warmup_batches)
    max_lag: int | None  # max_off_policy_threshold: versions a trained group may lag the policy; None: unbounded
    wait: bool = False  # max_off_policy_strategy=wait: each step takes its own batch's groups (see take)
    version: int = 0  # the policy version the engine holds: the number of updates in its weights
    engine: HFRollout | None = None  # see bind
    share: Callable[[int], list[Prompt]] | None = None
    groups: list[InFlightGroup] = field(default_factory=list)
    added_through: int = -1  # the last prompt batch added
    taken: dict[int, set[int]] = field(default_factory=dict)
    restored: bool = False  # resumed from a checkpoint: its groups in flight are to be added again

    def bind(self, engine: HFRollout, share: Callable[[int], list[Prompt]]) -> None:
        """The engine that decodes and this rank's share of a prompt batch (`share(number)`), which exist only once
        the run is built: the pool itself is made first, so that a checkpoint can restore it."""
        self.engine, self.share = engine, share

    def top_up(self, through: int) -> None:
        """Add the prompt batches after the last one added, through batch `through` (after a resume, first the
        checkpoint's groups in flight, drawn again from their start)."""
        if self.restored:
            for batch in sorted(self.taken):
                self.add(batch)
            self.restored = False
        for batch in range(self.added_through + 1, through + 1):
            self.taken[batch] = set()
            self.add(batch)
        self.added_through = max(self.added_through, through)

    def add(self, batch: int) -> None:
        self.groups += [InFlightGroup(prompt, batch, index, [Response() for _ in range(self.n)])
                        for index, prompt in enumerate(self.share(batch)) if index not in self.taken[batch]]

    def take(self, number: int, request: Any) -> tuple[list[InFlightGroup], int]:
        """The groups that prompt batch `number`'s step trains on (as many as this rank's share of a batch), decoded
        (`request`: a sampling.RolloutRequest) for as long as fewer are complete, and how many complete groups were
        dropped first for lagging the policy by more than max_lag (their places taken by the next prompt batch's
        groups), the batches through `number + lead` in flight. With `drop`, the oldest complete groups; with
        `wait`, batch `number`'s own groups, waited for: a group starts at most `lead` updates before the step that
        trains it (the plan keeps lead within max_lag), and none is dropped."""
        self.top_up(number + self.lead)
        wanted = (lambda g: g.batch == number) if self.wait else (lambda g: True)
        count = sum(map(wanted, self.groups)) if self.wait else len(self.share(number))
        version, chosen, dropped = self.version, [], 0
        self.engine.wake_up()
        while len(chosen) < count:
            if len(self.groups) < count - len(chosen):
                self.top_up(self.added_through + 1)
            self.decode_until(count - len(chosen), request, wanted)
            complete = [g for g in self.groups if g.complete and wanted(g)]
            stale = [g for g in complete if not self.wait and self.max_lag is not None and version - g.oldest_version > self.max_lag]
            fresh = [g for g in complete if g not in stale][: count - len(chosen)]
            for group in [*stale, *fresh]:
                self.groups.remove(group)
                self.taken[group.batch].add(group.index)
            chosen += fresh
            dropped += len(stale)
        self.engine.sleep()
        self.taken = {b: done for b, done in self.taken.items() if any(g.batch == b for g in self.groups)}
        return chosen, dropped

    def decode_until(self, count: int, request: Any, wanted: Callable[[InFlightGroup], bool]) -> None:
        """Decode the live responses, oldest first in batches of whole groups, until `count` of the `wanted` groups
        are complete."""
        engine = self.engine
        warp = warpers(request.temperature, request.top_k, request.top_p) if request.do_sample else LogitsProcessorList()
        per_batch = max(1, request.batch_size // request.n) * min(request.n, request.batch_size)
        while sum(g.complete for g in self.groups if wanted(g)) < count:
            rows = [(g, r) for g in self.groups for r in g.responses if not r.finished][:per_batch]
            # a sequence is its tokens and its prompt's images: the same question of two images is two sequences
            sequences = [(g.prompt.images, tuple(g.prompt.ids + r.tokens)) for g, r in rows]
            distinct = list({(id(images), tokens): (images, tokens) for images, tokens in sequences}.values())
            where = {(id(images), tokens): i for i, (images, tokens) in enumerate(distinct)}
            images = [images for images, _ in distinct] if any(images is not None for images, _ in distinct) else None
            cache, logits, attention_mask, positions = prefill(engine.model, [list(tokens) for _, tokens in distinct], engine.pad_id, images)
            index = torch.tensor([where[id(images), tokens] for images, tokens in sequences], device=logits.device)
            cache.reorder_cache(index)
            budgets = torch.tensor([request.max_new_tokens - len(r.tokens) for _, r in rows])
            decoded = decode(engine.model, cache, logits[index], attention_mask[index], positions[index], int(budgets.max()), engine.end_ids,
                             engine.pad_id, warp, request.do_sample, temperature=request.temperature, budgets=budgets,
                             enough=self.enough_when(rows, count, wanted), version=self.version, placeholder_ids=engine.placeholder_ids)
            unfinished = set(decoded.unfinished)
            for row, ((_, response), drawn) in enumerate(zip(rows, decoded.drawn.tolist())):
                response.tokens += decoded.tokens[row, :drawn].tolist()
                response.log_probs += decoded.log_probs[row, :drawn].tolist()
                response.versions += decoded.versions[row, :drawn].tolist()
                response.finished = row not in unfinished

    def enough_when(self, rows: list[tuple[InFlightGroup, Response]], count: int,
                    wanted: Callable[[InFlightGroup], bool]) -> Callable[[list[int]], bool]:
        """When to stop decoding `rows` (given the rows still going): once `count` of the `wanted` groups are
        complete, or once fewer than half of a batch go on while other responses wait, which then join them (the
        live ones prefilled again with the newcomers: continuous batching, at the cost of a prefill per refill)."""
        complete = sum(g.complete for g in self.groups if wanted(g))
        groups_in_batch, responses_in_batch = {id(g) for g, _ in rows}, {id(r) for _, r in rows}
        # the wanted groups whose every unfinished response is decoded in this batch, by the batch's rows they wait for
        waiting = [[row for row, (group, _) in enumerate(rows) if group is g] for g in self.groups
                   if wanted(g) and id(g) in groups_in_batch and all(id(r) in responses_in_batch for r in g.responses if not r.finished)]
        others_wait = sum(not r.finished for g in self.groups for r in g.responses) > len(rows)
        refill_below = len(rows) // 2 if others_wait else 0

        def enough(going: list[int]) -> bool:
            still = set(going)
            return len(going) < refill_below or complete + sum(not set(wait) & still for wait in waiting) >= count

        return enough

    def state_dict(self) -> dict[str, dict]:
        """Every rank's groups taken of the batches in flight (a collective: every training rank calls it)."""
        mine = {"added_through": self.added_through, "taken": {b: sorted(done) for b, done in self.taken.items()}}
        return {"ranks": gather_lists([mine], self.parallel.group)}

    def load_state_dict(self, state: dict) -> None:
        ranks = state["ranks"]
        if len(ranks) != self.parallel.world_size:
            raise ConfigError(f"colocate_async: the checkpoint's responses in flight were drawn on {len(ranks)} ranks, this run has "
                              f"{self.parallel.world_size}: resume it on as many")
        mine = ranks[self.parallel.rank]
        self.taken, self.added_through = {b: set(done) for b, done in mine["taken"].items()}, mine["added_through"]
        self.groups, self.restored = [], True
