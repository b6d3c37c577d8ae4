"""Answering and scoring a set of prompts, the library half of `python -m fsdptrain.evaluate`: the records of a
rollout engine's responses, their summary per data_source, and the GRPO trainer's validation on every rank (verl's
`val-core/` metrics), scored as training scores (the reward function, the reward model, the remote server)."""

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import gather_lists
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rollout.base import Generation, RolloutEngine, group_ids
from fsdptrain.rl.sampling import RolloutRequest, generate

# (responses, prompts, each response's group: the index of its prompt) -> each response's scores: `score`, `acc`,
# `response`, `response_length`, and any its sources add
Score = Callable[[Sequence[Generation], Sequence[Prompt], Sequence[int]], list[dict]]

if TYPE_CHECKING:
    from fsdptrain.rl.agent.loop import Loop


def summarize(records: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per data_source: count, accuracy and its binomial standard error, mean score and length, truncations."""
    by_source = defaultdict(list)
    for record in records:
        by_source[record["data_source"]].append(record)
    summary = {}
    for source, rows in sorted(by_source.items()):
        count = len(rows)
        accuracy = sum(r["acc"] for r in rows) / count
        summary[source] = {
            "n": count,
            "acc": accuracy,
            "acc_se": math.sqrt(accuracy * (1 - accuracy) / count),
            "score": sum(r["score"] for r in rows) / count,
            "response_length": sum(r["response_length"] for r in rows) / count,
            "truncated": sum(r["truncated"] for r in rows),
        }
    return summary


def evaluate(engine: RolloutEngine, loops: "dict[str, Loop]", prompts: Sequence[Prompt], score: Score, request: RolloutRequest) -> list[dict]:
    """One record per response of the agent `loops` on a rollout engine (sampling.generate), `request.n` per
    prompt: prompt, response, its scores (a multi-turn trajectory's turns and tool calls)."""
    responses = generate(engine, loops, prompts, request)
    ids = group_ids(len(prompts), request.n)
    records = []
    for response, group, scores in zip(responses, ids, score(responses, prompts, ids), strict=True):
        prompt = prompts[group]
        records.append({"index": group, "data_source": prompt.data_source, "prompt": prompt.messages,
                        "ground_truth": prompt.ground_truth, "truncated": response.truncated, **scores,
                        **({} if response.trace is None else {"tool_calls": response.trace.tool_calls, "turns": response.trace.messages})})
    return records


def validate_on_ranks(engine: RolloutEngine, loops: "dict[str, Loop]", prompts: Sequence[Prompt], score: Score, request: RolloutRequest,
                      parallel: Parallel) -> dict[str, float]:
    """The GRPO trainer's validation: accuracy and mean reward per data_source (verl's `val-core/` metrics), each
    rank answering a share of the prompts."""
    mine = list(prompts[parallel.rank :: parallel.world_size])
    # Every rank calls the engine and the scorer, with or without prompts: a tensor-parallel engine needs all of its
    # ranks, and a reward model's forward passes are collectives.
    records = evaluate(engine, loops, mine, score, request)
    metrics = {}
    for source, figures in summarize(gather_lists(records)).items():
        metrics[f"val-core/{source}/acc/mean@{request.n}"] = figures["acc"]
        metrics[f"val-core/{source}/reward/mean@{request.n}"] = figures["score"]
    return metrics
