"""The pictures of an RL run: score, response length, each reward source and validation accuracy against the step, and the latest
step's response lengths, as PNG files (matplotlib, drawn off screen). Also a command, for a run's metrics file:

    python -m fsdptrain.logging.plots RUN_DIR/metrics.jsonl OUT_DIR
"""

import json
import os
import sys
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the off-screen backend)


def _save(figure, path: str) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _band(history: Sequence[dict], key: str, label: str, title: str, path: str) -> str:
    """The mean of `key` per step, with its min-max band."""
    steps = [m["step"] for m in history]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(steps, [m[f"{key}/mean"] for m in history], label="mean")
    axes.fill_between(steps, [m[f"{key}/min"] for m in history], [m[f"{key}/max"] for m in history], alpha=0.2, label="min-max")
    axes.set(xlabel="step", ylabel=label, title=title)
    axes.legend()
    return _save(figure, path)


def write_plots(history: Sequence[dict], response_lengths: Sequence[int] | None, directory: str) -> list[str]:
    """`{directory}/score.png` and `response_length.png` (mean, min and max per step), `reward_sources.png` (each
    weighted reward source's mean score, where there are several), `val_acc.png` (each validation accuracy metric,
    where any was logged), `turns.png` and `tools.png` (a multi-turn run's turns, and tool calls and failures per
    trajectory) and, given the latest step's response lengths, `response_length_hist.png`. Returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = [_band(history, "critic/score", "score", "Training score", os.path.join(directory, "score.png")),
             _band(history, "response_length", "tokens", "Response length", os.path.join(directory, "response_length.png"))]
    sources = sorted({k for m in history for k in m if k.startswith("critic/rewards/") and k.endswith("/mean") and k.count("/") == 3})
    if sources:
        figure, axes = plt.subplots(figsize=(6, 4))
        for key in sources:
            axes.plot([m["step"] for m in history], [m[key] for m in history], label=key.split("/")[2])
        axes.set(xlabel="step", ylabel="mean score", title="Reward sources (unweighted)")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "reward_sources.png")))
    accuracies = sorted({k for m in history for k in m if k.startswith("val-core/") and "/acc/" in k})
    if accuracies:
        figure, axes = plt.subplots(figsize=(6, 4))
        for key in accuracies:
            points = [(m["step"], m[key]) for m in history if key in m]
            axes.plot(*zip(*points), marker="o", label=key.removeprefix("val-core/"))
        axes.set(xlabel="step", ylabel="accuracy", title="Validation accuracy")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "val_acc.png")))
    if "num_turns/mean" in history[-1]:
        paths.append(_band(history, "num_turns", "turns", "Turns per trajectory", os.path.join(directory, "turns.png")))
        figure, axes = plt.subplots(figsize=(6, 4))
        for name in ("tool_calls", "tool_errors", "tool_timeouts", "format_errors"):
            axes.plot([m["step"] for m in history], [m[f"multi_turn/{name}_per_trajectory"] for m in history], label=name.replace("_", " "))
        axes.set(xlabel="step", ylabel="per trajectory", title="Tool calls")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "tools.png")))
    if response_lengths:
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.hist(response_lengths, bins=min(30, len(set(response_lengths))))
        axes.set(xlabel="tokens", ylabel="responses", title=f"Response lengths at step {history[-1]['step']}")
        paths.append(_save(figure, os.path.join(directory, "response_length_hist.png")))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        print("\n".join(write_plots([json.loads(line) for line in f], None, sys.argv[2])))
