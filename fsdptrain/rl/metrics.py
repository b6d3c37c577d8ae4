"""What a GRPO step reports: verl's per-step data metrics over every sample, the rollout dump, and the plots."""

import hashlib
import io
import json
import math
import os
from collections.abc import Sequence

import torch
from PIL import Image

from fsdptrain.data.dataset import Sample
from fsdptrain.distributed.mesh import Parallel
from fsdptrain.distributed.reductions import all_reduce_sum, gather_lists, max_over_ranks
from fsdptrain.logging.metrics import MetricLogger
from fsdptrain.logging.plots import write_plots
from fsdptrain.rl.data import Prompt
from fsdptrain.rl.rewards import SOURCE
from fsdptrain.rl.rollout.base import Generation


def global_stats(name: str, values: Sequence[float], parallel: Parallel) -> dict[str, float]:
    """Mean, max and min of per-sample values over the step (each sample once: the data-parallel group)."""
    total, count = all_reduce_sum([float(sum(values)), float(len(values))], parallel.device, parallel.dp_group)
    return {f"{name}/mean": total / max(count, 1.0), f"{name}/max": max_over_ranks(max(values, default=-math.inf), parallel.device, parallel.group),
            f"{name}/min": -max_over_ranks(-min(values, default=math.inf), parallel.device, parallel.group)}


def source_metrics(scored: Sequence[dict], parallel: Parallel) -> dict[str, float]:
    """Each reward source's mean score over the step (critic/rewards/NAME/mean); none without sources (every rank
    has the same keys, so every rank skips the reduction alike)."""
    names = sorted(key for key in scored[0] if key.startswith(SOURCE))
    if not names:
        return {}
    means = all_reduce_sum([float(sum(s[key] for s in scored)) for key in names] + [float(len(scored))], parallel.device, parallel.dp_group)
    return {f"critic/rewards/{key.removeprefix(SOURCE)}/mean": total / means[-1] for key, total in zip(names, means)}


def critic_metrics(samples: Sequence[Sample], generations: Sequence[Generation], parallel: Parallel) -> dict[str, float]:
    """verl's critic data metrics over every rank's response tokens: the critic's values before its update, the
    returns, and the share of the returns' variance that the values explain."""
    values, returns = ([sample.token_values[key][len(g.prompt_ids):][g.mask > 0] for sample, g in zip(samples, generations)]
                       for key in ("values", "returns"))
    values, returns = torch.cat(values).double(), torch.cat(returns).double()
    count, *sums = all_reduce_sum([float(len(values)), float(values.sum()), float(returns.sum()), float(returns.square().sum()),
                                   float((returns - values).sum()), float((returns - values).square().sum())], parallel.device, parallel.dp_group)
    value_sum, return_sum, return_squares, error_sum, error_squares = sums

    def variance(total: float, squares: float) -> float:  # Bessel-corrected, as torch.var
        return (squares - total**2 / count) / max(count - 1, 1.0)

    metrics = {}
    for name, tensor, total in (("values", values, value_sum), ("returns", returns, return_sum)):
        metrics[f"critic/{name}/mean"] = total / max(count, 1.0)
        metrics[f"critic/{name}/max"] = max_over_ranks(float(tensor.max()) if len(tensor) else -math.inf, parallel.device, parallel.group)
        metrics[f"critic/{name}/min"] = -max_over_ranks(-float(tensor.min()) if len(tensor) else -math.inf, parallel.device, parallel.group)
    metrics["critic/vf_explained_var"] = 1.0 - variance(error_sum, error_squares) / (variance(return_sum, return_squares) + 1e-5)
    return metrics


def step_metrics(prompts: Sequence[Prompt], generations: Sequence[Generation], group_ids: torch.Tensor, scores: torch.Tensor,
                 token_rewards: list[torch.Tensor], response_advantages: list[float], parallel: Parallel) -> dict[str, float]:
    """verl's per-step data metrics over every sample of the step, and its token count for the throughput. The
    response lengths count the tokens the policy generated (not a multi-turn trajectory's tool or user tokens)."""
    lengths = [g.generated_tokens for g in generations]
    metrics = {**global_stats("critic/score", scores.tolist(), parallel),
               "critic/rewards/mean": global_stats("critic/rewards", [float(r.sum()) for r in token_rewards], parallel)["critic/rewards/mean"],
               **global_stats("critic/advantages", response_advantages, parallel), **global_stats("response_length", lengths, parallel)}
    prompt_stats = global_stats("prompt_length", [len(p.ids) for p in prompts], parallel)
    metrics.update({k: v for k, v in prompt_stats.items() if not k.endswith("/min")})
    group_spread = torch.stack([scores[group_ids == g].std() if int((group_ids == g).sum()) > 1 else torch.zeros((), dtype=scores.dtype)
                                for g in group_ids.unique()])
    tokens, truncated, responses, zero_std, groups = all_reduce_sum(
        [float(sum(len(g.prompt_ids) + len(g.response_ids) for g in generations)), float(sum(g.truncated for g in generations)),
         float(len(lengths)), float((group_spread == 0).sum()), float(len(group_spread))], parallel.device, parallel.dp_group)
    metrics["response_length/clip_ratio"] = truncated / max(responses, 1.0)
    metrics["frac_reward_zero_std"] = zero_std / max(groups, 1.0)
    metrics["perf/tokens"] = tokens
    return metrics


def multi_turn_metrics(generations: Sequence[Generation], parallel: Parallel) -> dict[str, float]:
    """Over every trajectory of the step: turns (verl's num_turns), tool calls and their failures per trajectory,
    the environments' success rate (where an interaction reports `success`), and the share of trajectories whose
    full re-render tokenizes otherwise (`multi_turn/drift_rate`, over the checked ones). Responses of a one-turn
    loop (no trace) are left out."""
    traces = [g.trace for g in generations if g.trace is not None]
    metrics = global_stats("num_turns", [float(t.num_turns) for t in traces], parallel)
    counts = ("tool_calls", "tool_errors", "tool_timeouts", "format_errors")
    totals = all_reduce_sum([float(sum(getattr(t, name) for t in traces)) for name in counts]
                            + [float(len(traces)), float(sum(t.success is not None for t in traces)), float(sum(bool(t.success) for t in traces)),
                               float(sum(t.drift is not None for t in traces)), float(sum(bool(t.drift) for t in traces))],
                            parallel.device, parallel.dp_group)
    *sums, trajectories, with_success, successes, checked, drifted = totals
    metrics.update({f"multi_turn/{name}_per_trajectory": total / max(trajectories, 1.0) for name, total in zip(counts, sums)})
    if with_success:
        metrics["multi_turn/success_rate"] = successes / with_success
    if checked:
        metrics["multi_turn/drift_rate"] = drifted / checked
    return metrics


def plot(history: list[dict], lengths: list[int], directory: str, logger: MetricLogger, parallel: Parallel, step: int) -> None:
    """The plots of the steps so far into `directory` (rank 0 draws them from every sample's response length)."""
    every_length = gather_lists(lengths, parallel.dp_group)
    if parallel.is_main:
        logger.log_images(write_plots(history, every_length, directory), step)


def dump_rollouts(directory: str, step: int, prompts: Sequence[Prompt], group_ids: Sequence[int], scored: list[dict],
                  generations: Sequence[Generation], advantages: list[float], parallel: Parallel, origins: Sequence[tuple[int, int]]) -> None:
    """`{directory}/{step}.jsonl`: each response with its prompt, ground truth, scores and advantage, the prompt
    batch it was drawn in and the oldest policy version that generated it (`origins`, by group; with partial
    rollouts each token's, `token_versions`), and the token ids that were trained on (response_mask 1); a multi-turn trajectory's turns, each marked `trained` or not, with its
    counts; a vision-language model's prompt images (`images`, see dumped_images) with their patch grids
    (`image_grid_thw`). Rank 0 writes."""
    files: dict[str, bytes] = {}
    rows = []
    for group, s, g, a in zip(group_ids, scored, generations, advantages):
        images = dumped_images(prompts[group].stored_images, files) if prompts[group].stored_images else None
        rows.append({"prompt": prompts[group].messages, "ground_truth": prompts[group].ground_truth, "data_source": prompts[group].data_source,
                     **s, "advantage": a, "batch": origins[group][0], "policy_version": origins[group][1],
                     "prompt_ids": g.prompt_ids, "response_ids": g.response_ids, "response_mask": g.response_mask,
                     **({} if g.versions is None else {"token_versions": g.versions}),
                     **({} if images is None else {"images": images}),
                     **({} if g.images is None else {"image_grid_thw": g.images.inputs["image_grid_thw"].tolist()}),
                     **({} if g.trace is None else {"turns": g.trace.messages, "trace": {k: v for k, v in vars(g.trace).items() if k != "messages"}})})
    every_row = gather_lists(rows, parallel.dp_group)
    every_file = {name: data for ranks in gather_lists([files], parallel.dp_group) for name, data in ranks.items()}
    if parallel.is_main:
        os.makedirs(directory, exist_ok=True)
        for name, data in every_file.items():
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(f"{path}.tmp", "wb") as f:
                    f.write(data)
                os.replace(f"{path}.tmp", path)
        with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:
            for row in every_row:
                f.write(json.dumps(row, default=str) + "\n")


def dumped_images(stored: Sequence, files: dict[str, bytes]) -> list[str]:
    """A prompt's images as a rollout dump names them: an image the row gives by path, its path; one it holds as
    bytes, `images/<sha1 of the bytes>.<format>` beside the dump, its bytes added to `files` to be written there
    once (the same image in every step's dump is one file)."""
    names = []
    for value in stored:
        data = value.get("bytes") if isinstance(value, dict) else value if isinstance(value, bytes) else None
        if data is None:
            names.append(value.get("path") or value.get("image") if isinstance(value, dict) else str(value))
            continue
        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format or "img").lower()
        name = f"images/{hashlib.sha1(data).hexdigest()}.{kind}"
        files[name] = data
        names.append(name)
    return names
