"""The pictures of an RL run: score and validation accuracy against the step, and the latest step's response
lengths, as PNG files (matplotlib, drawn off screen)."""

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the off-screen backend)


def _save(figure, path: str) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_plots(history: Sequence[dict], response_lengths: Sequence[int], directory: str) -> list[str]:
    """`{directory}/score.png` (mean, min and max score per step), `val_acc.png` (each validation accuracy metric,
    where any was logged) and `response_length.png` (the histogram of the latest step). Returns the paths."""
    os.makedirs(directory, exist_ok=True)
    steps = [m["step"] for m in history]
    paths = []
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(steps, [m["critic/score/mean"] for m in history], label="mean")
    axes.fill_between(steps, [m["critic/score/min"] for m in history], [m["critic/score/max"] for m in history], alpha=0.2, label="min-max")
    axes.set(xlabel="step", ylabel="score", title="Training score")
    axes.legend()
    paths.append(_save(figure, os.path.join(directory, "score.png")))
    accuracies = sorted({k for m in history for k in m if k.startswith("val-core/") and "/acc/" in k})
    if accuracies:
        figure, axes = plt.subplots(figsize=(6, 4))
        for key in accuracies:
            points = [(m["step"], m[key]) for m in history if key in m]
            axes.plot(*zip(*points), marker="o", label=key.removeprefix("val-core/"))
        axes.set(xlabel="step", ylabel="accuracy", title="Validation accuracy")
        axes.legend()
        paths.append(_save(figure, os.path.join(directory, "val_acc.png")))
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.hist(response_lengths, bins=min(30, max(1, len(set(response_lengths)))))
    axes.set(xlabel="tokens", ylabel="responses", title=f"Response lengths at step {steps[-1]}")
    paths.append(_save(figure, os.path.join(directory, "response_length.png")))
    return paths
