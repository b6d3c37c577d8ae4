"""The pictures of a run, as PNG files (matplotlib, drawn off screen): an SFT run's loss (and validation loss),
learning rate, gradient norm and throughput; an RL run's score, response length, each reward source and validation
accuracy against the step, and the latest step's response lengths. Also a command, for either trainer's metrics file:

    python -m fsdptrain.logging.plots RUN_DIR/metrics.jsonl OUT_DIR
"""

import json
import os
import sys
from collections.abc import Sequence


def pyplot():
    """matplotlib's pyplot on the off-screen backend, imported when a picture is drawn (not with the trainers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: str) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot().close(figure)
    return path


def _band(history: Sequence[dict], key: str, label: str, title: str, path: str) -> str:
    """The mean of `key` per step, with its min-max band."""
    steps = [m["step"] for m in history]
    figure, axes = pyplot().subplots(figsize=(6, 4))
    axes.plot(steps, [m[f"{key}/mean"] for m in history], label="mean")
    axes.fill_between(steps, [m[f"{key}/min"] for m in history], [m[f"{key}/max"] for m in history], alpha=0.2, label="min-max")
    axes.set(xlabel="step", ylabel=label, title=title)
    axes.legend()
    return _save(figure, path)


# An SFT run's curves: file, title, y label, and the metrics drawn on it (each where it was logged).
CURVES = (
    ("loss.png", "Loss", "loss per token", ("train/loss", "val/loss")),
    ("lr.png", "Learning rate", "lr", ("train/lr",)),
    ("grad_norm.png", "Gradient norm (before clipping)", "norm", ("train/grad_norm",)),
    ("tokens_per_sec.png", "Throughput", "tokens/s", ("perf/tokens_per_sec",)),
)


def _curves(history: Sequence[dict], title: str, label: str, keys: Sequence[str], path: str) -> str:
    figure, axes = pyplot().subplots(figsize=(6, 4))
    for key in keys:
        points = [(m["step"], m[key]) for m in history if key in m]
        if points:
            axes.plot(*zip(*points), marker="o" if len(points) < len(history) else None, label=key)
    axes.set(xlabel="step", ylabel=label, title=title)
    axes.legend()
    return _save(figure, path)


def write_plots(history: Sequence[dict], response_lengths: Sequence[int] | None, directory: str) -> list[str]:
    """Every picture the metrics in `history` (one dict a step) make, into `directory`; returns the paths. SFT:
    `loss.png`, `lr.png`, `grad_norm.png`, `tokens_per_sec.png`. RL: `score.png` and `response_length.png` (mean,
    min and max per step), `reward_sources.png` (each weighted reward source's mean score, where there are
    several), `val_acc.png` (each validation accuracy metric, where any was logged), `turns.png` and `tools.png` (a
    multi-turn run's turns, and tool calls and failures per trajectory) and, given the latest step's response
    lengths, `response_length_hist.png`."""
    os.makedirs(directory, exist_ok=True)
    logged = {k for m in history for k in m}
    paths = [_curves(history, title, label, keys, os.path.join(directory, name))
             for name, title, label, keys in CURVES if keys[0] in logged]
    for key, label, title, name in (("critic/score", "score", "Training score", "score.png"),
                                    ("response_length", "tokens", "Response length", "response_length.png")):
        if f"{key}/mean" in logged:
            paths.append(_band(history, key, label, title, os.path.join(directory, name)))
    sources = sorted(k for k in logged if k.startswith("critic/rewards/") and k.endswith("/mean") and k.count("/") == 3)
    if sources:
        figure, axes = pyplot().subplots(figsize=(6, 4))
        for key in sources:
            axes.plot([m["step"] for m in history], [m[key] for m in history], label=key.split("/")[2])
        axes.set(xlabel="step", ylabel="mean score", title="Reward sources (unweighted)")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "reward_sources.png")))
    accuracies = sorted(k for k in logged if k.startswith("val-core/") and "/acc/" in k)
    if accuracies:
        figure, axes = pyplot().subplots(figsize=(6, 4))
        for key in accuracies:
            points = [(m["step"], m[key]) for m in history if key in m]
            axes.plot(*zip(*points), marker="o", label=key.removeprefix("val-core/"))
        axes.set(xlabel="step", ylabel="accuracy", title="Validation accuracy")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "val_acc.png")))
    if "num_turns/mean" in history[-1]:
        paths.append(_band(history, "num_turns", "turns", "Turns per trajectory", os.path.join(directory, "turns.png")))
        figure, axes = pyplot().subplots(figsize=(6, 4))
        for name in ("tool_calls", "tool_errors", "tool_timeouts", "format_errors"):
            axes.plot([m["step"] for m in history], [m[f"multi_turn/{name}_per_trajectory"] for m in history], label=name.replace("_", " "))
        axes.set(xlabel="step", ylabel="per trajectory", title="Tool calls")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "tools.png")))
    if response_lengths:
        figure, axes = pyplot().subplots(figsize=(6, 4))
        axes.hist(response_lengths, bins=min(30, len(set(response_lengths))))
        axes.set(xlabel="tokens", ylabel="responses", title=f"Response lengths at step {history[-1]['step']}")
        paths.append(_save(figure, os.path.join(directory, "response_length_hist.png")))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        drawn = write_plots([json.loads(line) for line in f if line.strip()], None, sys.argv[2])
    if not drawn:
        raise SystemExit(f"{sys.argv[1]}: no metric that these plots draw (train/loss for SFT, critic/score/mean for RL)")
    print("\n".join(drawn))
