"""Which prompts a step trains on: prompts fitted to their length limit, the batch the step draws (resumable, the
same seeds after a resume), generated and scored as groups of `n` responses, and DAPO's dynamic sampling, which
keeps drawing until enough groups teach something."""

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from fsdptrain.data.batching import epoch_batches
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, gather_lists
from fsdptrain.errors import ConfigError, UserError
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rewards import Scorer
from fsdptrain.rl.rollout.base import Generation, RolloutEngine, group_ids
from fsdptrain.rl.rollout.in_flight import ResponsePool
from fsdptrain.rl.rollout.remote import RemoteRollout

if TYPE_CHECKING:
    from fsdptrain.rl.agent.loop import Loop

log = logging.getLogger("fsdptrain")

# algorithm.filter_groups.metric -> the score that must vary within a group (no KL in the reward yet)
FILTER_KEYS = {"acc": "acc", "score": "score", "seq_reward": "seq_reward", "seq_final_reward": "seq_reward"}


def fit_prompts(prompts: list[Prompt], limit: int, truncation: str, drop_overlong: bool, source: str) -> list[Prompt]:
    """Prompts within `limit` tokens (data.max_prompt_length): longer ones dropped (counted) with `drop_overlong`
    (data.filter_overlong_prompts), else cut by `truncation` (data.truncation; `error` names the row)."""
    kept = []
    for row, prompt in enumerate(prompts):
        if len(prompt.ids) <= limit:
            kept.append(prompt)
        elif drop_overlong:
            continue
        elif truncation == "error" or prompt.images is not None:
            why = "data.truncation=error" if truncation == "error" else "a prompt with images is never cut: its images would not match"
            raise ConfigError(f"{source} row {row}: the prompt has {len(prompt.ids)} tokens, over data.max_prompt_length={limit} "
                              f"({why}; data.filter_overlong_prompts=false)")
        else:
            prompt.ids = prompt.ids[-limit:] if truncation == "left" else prompt.ids[:limit]
            kept.append(prompt)
    if len(kept) < len(prompts):
        log.warning("dropped %d of %d prompts of %s over data.max_prompt_length=%d", len(prompts) - len(kept), len(prompts), source, limit)
    if not kept:
        raise ConfigError(f"{source}: no prompt fits data.max_prompt_length={limit}")
    return kept


@dataclass
class Group:
    """One prompt with its responses (`rollout.n` of them when sampled) and their scores."""

    prompt: Prompt
    generations: list[Generation]
    scored: list[dict]
    batch: int = -1  # the prompt batch it was drawn in (PromptCursor's count)
    policy_version: int | None = None  # the updates in the weights that drew its oldest token (the asynchronous modes); None: the current ones


def flatten(groups: Sequence[Group]) -> tuple[list[Generation], list[int]]:
    """Every response of `groups` in order, with its group's index among them: the explicit ids (verl's `index`)
    by which scores, shaping, advantages and metrics find a response's prompt and group, whatever the groups'
    sizes."""
    return [g for group in groups for g in group.generations], [i for i, group in enumerate(groups) for _ in group.generations]


class PromptCursor:
    """How many batches of prompts the run has drawn: one a step, more with filter_groups. Checkpointed, so that a
    resumed run draws the batches, and samples with the seeds, that an uninterrupted one would."""

    def __init__(self):
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = state["batches"]


@dataclass(frozen=True)
class RolloutRequest:
    """How each prompt is answered (actor_rollout_ref.rollout.*, data.max_response_length): the keyword arguments
    of RolloutEngine.generate and AgentLoop.generate."""

    n: int
    max_new_tokens: int
    batch_size: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    calculate_log_probs: bool


# (prompts, request) -> `request.n` responses to each prompt, n in a row: the engine here (`local_answers`), or a
# standalone rollout rank (rl/rollout/remote.py)
Answer = Callable[[Sequence[Prompt], RolloutRequest], list[Generation]]


def local_answers(engine: RolloutEngine, loops: "dict[str, Loop]") -> Answer:
    return lambda prompts, request: generate(engine, loops, prompts, request)


def generate(engine: RolloutEngine, loops: "dict[str, Loop]", prompts: Sequence[Prompt], request: RolloutRequest) -> list[Generation]:
    """`request.n` responses to each prompt (n in a row), each prompt answered by the loop its `agent_name` names
    (a key of `loops`, the same on every rank). Every rank calls every loop, in one order, with or without prompts:
    the ranks of a tensor-parallel engine call it together. The engine is awake only while it generates (on a GPU,
    it frees the accelerator for training the rest of the time)."""
    engine.wake_up()
    n, generations = request.n, [None] * (len(prompts) * request.n)
    for name, loop in loops.items():
        mine = [i for i, prompt in enumerate(prompts) if prompt.agent_name == name]
        answered = loop.generate([prompts[i] for i in mine], **asdict(request))
        for k, i in enumerate(mine):
            generations[i * n : (i + 1) * n] = answered[k * n : (k + 1) * n]
    engine.sleep()
    return generations


def group_versions(generations: Sequence[Generation], n: int, started: int) -> list[int]:
    """Each group's (`n` responses in a row) policy version: that of the weights that drew its oldest token, a
    response's first (a rollout rank draws a request in pieces, each under the newest weights it holds, and newer
    weights may come while a piece is drawn); `started`, the version the request began under, where the engine
    tags no token (a multi-turn trajectory, an empty response)."""
    firsts = [g.versions[0] if g.versions else started for g in generations]
    return [min(firsts[i : i + n]) for i in range(0, len(firsts), n)]


def with_answers(generations: list[Generation], prompts: Sequence[Prompt], n: int, answer_ids: Callable[[Prompt], list[int]]) -> list[Generation]:
    """MiniOneRec's add_gt: each group (n in a row) that lacks its prompt's answer (`answer_ids`: the ground truth's
    tokens and an end token) holds it in place of its last member (in beam search, the lowest-scoring beam)."""
    generations = list(generations)
    for i, prompt in enumerate(prompts):
        answer, group = answer_ids(prompt), generations[i * n : (i + 1) * n]
        if all(g.response_ids != answer for g in group):
            generations[(i + 1) * n - 1] = Generation(group[-1].prompt_ids, answer, [1] * len(answer), None, truncated=False, images=group[-1].images)
    return generations


@dataclass
class GroupSampler:
    """Draws each step's groups: this data-parallel rank's share of the next batch of `batch_size` prompts,
    generated (`answer`, or a standalone rollout rank: `remote`; with `pool`, colocate_async, as many groups from
    the responses in flight) and scored. The ranks of a Ulysses group generate
    a part each, then all hold the whole share. With `filter_metric` (dynamic sampling, a key of FILTER_KEYS) only
    groups whose score varies are kept."""

    prompts: Sequence[Prompt]
    batch_size: int
    shuffle: bool
    seed: int
    engine_index: int  # the ranks of one tensor-parallel engine sample from one seed
    request: RolloutRequest
    score: Scorer
    parallel: Parallel
    filter_metric: str | None = None
    max_gen_batches: int = 0
    cursor: PromptCursor = field(default_factory=PromptCursor)
    # Score in a worker thread while the step goes on (reward_model.launch_reward_fn_async; no dynamic sampling,
    # no Ulysses SP, no source with collectives): the groups come unscored, and `wait_for_scores` fills them in.
    score_later: bool = False
    answer: Answer | None = None  # the engine's agent loops (set once they exist), or the rollout rank's
    remote: RemoteRollout | None = None  # a standalone rollout rank generates the batches, asked ahead of time
    pool: ResponsePool | None = None  # colocate_async: the engine's responses in flight across steps
    dropped: int = 0  # colocate_async: groups dropped for lagging the policy too far, since next_groups began
    answer_ids: Callable[[Prompt], list[int]] | None = None  # rollout.add_gt: each group holds its prompt's answer
    worker: ThreadPoolExecutor | None = None
    pending: Future | None = None
    step_start: int = 0  # the cursor when the step began: a batch's distance from it is its expected steps ahead

    def next_groups(self) -> tuple[list[Group], dict[str, float]]:
        """The step's groups and, with dynamic sampling, how many batches it drew (`train/num_gen_batches`); with
        standalone rollout ranks, the waits on both sides and the requests still out (`async/*`)."""
        self.step_start, self.dropped = self.cursor.batches, 0
        if self.remote is not None:
            self.remote.waited = self.remote.idle = 0.0
        if self.filter_metric is None:
            groups, metrics = self.draw(), {}
        else:
            groups, rounds = self.varied_groups()
            metrics = {"train/num_gen_batches": rounds}
        if self.remote is not None:
            metrics.update({"async/trainer_wait_s": self.remote.waited, "async/rollout_idle_s": self.remote.idle,
                            "async/requests_ahead": float(len(self.remote.requested))})
        if self.pool is not None:
            metrics["async/dropped_groups"], metrics["async/in_flight_groups"] = all_reduce_sum([self.dropped, len(self.pool.groups)], self.parallel.device,
                                                                                                self.parallel.dp_group)
        return groups, metrics

    def batch_prompts(self, number: int) -> list[Prompt]:
        """This rank's share of prompt batch `number` (PromptCursor's count)."""
        parallel = self.parallel
        epoch, index = divmod(number, len(self.prompts) // self.batch_size)
        batch = epoch_batches(len(self.prompts), self.batch_size, self.seed, epoch, self.shuffle)[index]
        per_rank = self.batch_size // parallel.dp_size
        mine = batch[parallel.dp_rank * per_rank : (parallel.dp_rank + 1) * per_rank][parallel.sp_rank :: parallel.sp_size]
        return [self.prompts[i] for i in mine]

    def batch_seed(self, number: int) -> int:
        """The generator's seed for this rank's share of batch `number`."""
        return self.seed * 1_000_003 + number * self.parallel.world_size + self.engine_index

    def draw(self) -> list[Group]:
        parallel, cursor, request = self.parallel, self.cursor, self.request
        number = cursor.batches
        cursor.batches += 1
        if self.remote is None:
            torch.manual_seed(self.batch_seed(number))
        if self.pool is not None:
            in_flight, dropped = self.pool.take(number, request)
            self.dropped += dropped
            prompts, batches, versions = [g.prompt for g in in_flight], [g.batch for g in in_flight], [g.oldest_version for g in in_flight]
            generations = [r for g in in_flight for r in g.generations(self.pool.engine.end_ids, request.calculate_log_probs)]
        else:
            prompts = self.batch_prompts(number)
            batches = [number] * len(prompts)
            if self.remote is None:
                generations, versions = self.answer(prompts, request), [None] * len(prompts)
            else:
                result = self.remote.batch(number, lambda ahead: (self.batch_prompts(ahead), self.batch_seed(ahead)), request,
                                           lambda ahead: ahead - self.step_start)
                generations, versions = result.generations, group_versions(result.generations, request.n, result.version)
        if self.answer_ids is not None:
            generations = with_answers(generations, prompts, request.n, self.answer_ids)
        ids, scored = group_ids(len(prompts), request.n), []
        if self.score_later:  # the groups come unscored: `wait_for_scores` fills them in
            self.worker = self.worker or ThreadPoolExecutor(1, thread_name_prefix="fsdptrain-scoring")
            self.pending = self.worker.submit(self.score, generations, prompts, ids, f"prompt batch {cursor.batches}")
        else:
            scored = self.score(generations, prompts, ids, f"prompt batch {cursor.batches}")
        groups = [Group(prompt, [g for g, k in zip(generations, ids) if k == i], [s for s, k in zip(scored, ids) if k == i], batches[i], versions[i])
                  for i, prompt in enumerate(prompts)]
        return gather_lists(groups, parallel.ulysses_group) if parallel.sp_size > 1 else groups

    def greedy_scores(self, groups: Sequence[Group]) -> list[float]:
        """ReMax's baselines: each group's prompt answered once more, greedily, and scored as the training
        responses are (`seq_reward`)."""
        prompts = [group.prompt for group in groups]
        generations = self.answer(prompts, replace(self.request, n=1, do_sample=False, calculate_log_probs=False))
        scored = self.score(generations, prompts, group_ids(len(prompts), 1), f"the greedy baselines of prompt batch {self.cursor.batches}")
        return [s["seq_reward"] for s in scored]

    def wait_for_scores(self, groups: list[Group]) -> None:
        """With score_later, the drawn groups' scores, once the worker thread has them (its error raised here)."""
        if self.pending is None:
            return
        scored, self.pending = self.pending.result(), None
        start = 0
        for group in groups:
            group.scored, start = scored[start : start + len(group.generations)], start + len(group.generations)

    def varied_groups(self) -> tuple[list[Group], int]:
        """DAPO's dynamic sampling: draw batches, keeping the groups whose filter score varies (the others teach
        nothing: every advantage is 0), until batch_size of them are kept over all data-parallel ranks; this
        rank's share of the first batch_size, and the number of batches drawn."""
        parallel, key = self.parallel, FILTER_KEYS[self.filter_metric]
        kept: list[Group] = []
        rounds = total = 0
        while total < self.batch_size:
            if 0 < self.max_gen_batches <= rounds:  # non-positive: no limit, as verl
                raise UserError(f"algorithm.filter_groups: {int(total)} groups with varying {self.filter_metric} after max_num_gen_batches="
                                   f"{rounds} batches, fewer than data.train_batch_size={self.batch_size}; raise max_num_gen_batches, or "
                                   "use prompts that the policy sometimes solves")
            rounds += 1
            kept += [g for g in self.draw() if len(g.scored) == 1 or len({s[key] for s in g.scored}) > 1]
            (total,) = all_reduce_sum([len(kept)], parallel.device, parallel.dp_group)
        per_rank = self.batch_size // parallel.dp_size
        everyone = gather_lists(kept, parallel.dp_group)[: self.batch_size]
        return everyone[parallel.dp_rank * per_rank : (parallel.dp_rank + 1) * per_rank], rounds
