"""Answering and scoring a set of prompts, the library half of `python -m fsdptrain.evaluate`: the records of a
rollout engine's responses, their summary per data_source, and the GRPO trainer's validation on every rank (verl's
`val-core/` metrics), scored as training scores (the reward function, the reward model, the remote server)."""

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import gather_lists
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rewards import item_text
from fsdptrain.rl.rollout.base import Generation, group_ids
from fsdptrain.rl.sampling import Answer, RolloutRequest

# (responses, prompts, each response's group: the index of its prompt) -> each response's scores: `score`, `acc`,
# `response`, `response_length`, and any its sources add
Score = Callable[[Sequence[Generation], Sequence[Prompt], Sequence[int]], list[dict]]


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


RANKING_KS = (1, 5, 10)  # MiniOneRec's calc.py reports these (and more) cut-offs


def ranking_values(records: Sequence[dict], ks: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per prompt (`index`): HR@K and NDCG@K of its responses, in order, as recommendations with one relevant item
    (its ground truth; MiniOneRec's calc.py): r, the place of the first response that is the item; HR@K = [r < K],
    NDCG@K = [r < K] / log2(r + 2)."""
    responses: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        responses[record["index"]].append(record)
    values = {}
    for index, rows in responses.items():
        target = item_text(str(rows[0]["ground_truth"]))
        rank = next((r for r, row in enumerate(rows) if item_text(row["response"]) == target), math.inf)
        values[index] = {}
        for k in ks:
            values[index][f"hr@{k}"] = float(rank < k)
            values[index][f"ndcg@{k}"] = 1 / math.log2(rank + 2) if rank < k else 0.0
    return values


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error (the sample spread over sqrt(n))."""
    n = len(values)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(variance / n)


def ranking_summary(records: Sequence[dict], ks: Sequence[int]) -> dict[str, tuple[float, float]]:
    """HR@K and NDCG@K over the prompts, each with its standard error."""
    values = list(ranking_values(records, ks).values())
    return {name: mean_and_se([v[name] for v in values]) for name in values[0]} if values else {}


def evaluate(answer: Answer, prompts: Sequence[Prompt], score: Score, request: RolloutRequest) -> list[dict]:
    """One record per response that `answer` gives (the agent loops on a rollout engine: sampling.local_answers),
    `request.n` per prompt: prompt, response, its scores (a multi-turn trajectory's turns and tool calls)."""
    responses = answer(prompts, request)
    ids = group_ids(len(prompts), request.n)
    records = []
    for response, group, scores in zip(responses, ids, score(responses, prompts, ids), strict=True):
        prompt = prompts[group]
        records.append({"index": group, "data_source": prompt.data_source, "prompt": prompt.messages,
                        "ground_truth": prompt.ground_truth, "truncated": response.truncated, **scores,
                        **({} if response.trace is None else {"tool_calls": response.trace.tool_calls, "turns": response.trace.messages})})
    return records


def validate_on_ranks(answer: Answer, prompts: Sequence[Prompt], score: Score, request: RolloutRequest, parallel: Parallel,
                      ranked: bool = False) -> dict[str, float]:
    """The GRPO trainer's validation: accuracy and mean reward per data_source (verl's `val-core/` metrics), each
    rank answering a share of the prompts; `ranked` (beam search: a prompt's responses best first), also HR@K and
    NDCG@K for the cut-offs of RANKING_KS within the beams."""
    mine = list(prompts[parallel.rank :: parallel.world_size])
    # Every rank calls the engine and the scorer, with or without prompts: a tensor-parallel engine needs all of its
    # ranks, and a reward model's forward passes are collectives.
    records = evaluate(answer, mine, score, request)
    for record in records:  # a prompt's place in the whole set, so that the gathered records keep prompts apart
        record["index"] = parallel.rank + record["index"] * parallel.world_size
    records = gather_lists(records, parallel.group)
    metrics = {}
    for source, figures in summarize(records).items():
        metrics[f"val-core/{source}/acc/mean@{request.n}"] = figures["acc"]
        metrics[f"val-core/{source}/reward/mean@{request.n}"] = figures["score"]
    if ranked:
        for source in {record["data_source"] for record in records}:
            ranking = ranking_summary([r for r in records if r["data_source"] == source], [k for k in RANKING_KS if k <= request.n])
            metrics.update({f"val-core/{source}/{name}": mean for name, (mean, _) in ranking.items()})
    return metrics
