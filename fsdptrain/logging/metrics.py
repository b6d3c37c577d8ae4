"""Metric sinks chosen by `trainer.logger`: console, file (metrics.jsonl), wandb, tensorboard.

Only rank 0 logs; on other ranks the logger has no sinks, so nothing is printed once per rank.
"""

import json
import os
import sys
import time

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def _format(value: float) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


class FileSink:
    """JSON lines, one object per logged step. On resume, lines past the resume step are dropped first."""

    def __init__(self, directory: str, resume_step: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, METRICS_FILE)
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def log_images(self, paths: list[str], step: int) -> None:
        pass  # the PNG files are on disk already

    def close(self) -> None:
        self.file.close()


class ConsoleSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        tqdm.write(f"step {step} | " + " | ".join(f"{k} {_format(v)}" for k, v in metrics.items()))

    def log_images(self, paths: list[str], step: int) -> None:
        tqdm.write(f"step {step} | plots: {', '.join(paths)}")

    def close(self) -> None:
        pass


class WandbSink:
    def __init__(self, project: str, experiment: str, directory: str, config: dict):
        import wandb  # imported here: it is slow to import and only this sink needs it

        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=project, name=experiment, dir=directory, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_images(self, paths: list[str], step: int) -> None:
        import wandb

        self.run.log({f"plots/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p) for p in paths}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardSink:
    def __init__(self, directory: str, resume_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("trainer.logger includes tensorboard: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir=os.path.join(directory, "tensorboard"), purge_step=resume_step + 1)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_images(self, paths: list[str], step: int) -> None:
        from matplotlib.image import imread

        for path in paths:
            self.writer.add_image(f"plots/{os.path.splitext(os.path.basename(path))[0]}", imread(path)[..., :3], step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricLogger:
    def __init__(
        self,
        names: list[str],
        directory: str,
        project: str,
        experiment: str,
        config: dict,
        is_main: bool,
        resume_step: int = 0,
    ):
        self.sinks = []
        if not is_main:
            return
        for name in names:
            if name == "console":
                self.sinks.append(ConsoleSink())
            elif name == "file":
                self.sinks.append(FileSink(directory, resume_step))
            elif name == "wandb":
                self.sinks.append(WandbSink(project, experiment, directory, config))
            elif name == "tensorboard":
                self.sinks.append(TensorboardSink(directory, resume_step))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_images(self, paths: list[str], step: int) -> None:
        for sink in self.sinks:
            sink.log_images(paths, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class StepLines:
    """The progress bar's stand-in where output is captured (a log file, a pipe), where a redrawn bar would tangle
    with the step lines: one plain line a step, unless the console logger prints each step's line already."""

    def __init__(self, total: int, initial: int, quiet: bool):
        self.total, self.done, self.quiet, self.postfix = total, initial, quiet, {}
        self.start = time.monotonic()

    def set_postfix(self, **postfix: str) -> None:
        self.postfix = postfix

    def update(self, steps: int) -> None:
        self.done += steps
        if not self.quiet:
            shown = "".join(f", {k} {v}" for k, v in self.postfix.items())
            print(f"train: step {self.done}/{self.total} ({time.monotonic() - self.start:.0f} s{shown})", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, initial: int, is_main: bool, loggers: list[str]) -> tqdm | StepLines:
    """A bar on a terminal; plain lines elsewhere (StepLines); nothing on ranks other than the first."""
    if is_main and not sys.stderr.isatty():
        return StepLines(total, initial, quiet="console" in loggers)
    return tqdm(total=total, initial=initial, desc="train", disable=not is_main, dynamic_ncols=True)
