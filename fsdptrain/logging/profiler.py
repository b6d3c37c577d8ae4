"""One training step under torch.profiler (`trainer.profile_step`): where the step's time goes, per rank."""

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def profile_step(enabled: bool, step: int, out_dir: str, rank: int) -> Iterator[None]:
    """Profile the enclosed step when `enabled`: every rank writes a Chrome trace (`profile/step{N}_rank{R}.json`,
    open it in Perfetto) and an operator table sorted by self time (`profile/step{N}_rank{R}.txt`)."""
    if not enabled:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    folder = os.path.join(out_dir, "profile")
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"step{step}_rank{rank}.json"))
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=40, max_shapes_column_width=60)
    with open(os.path.join(folder, f"step{step}_rank{rank}.txt"), "w") as f:
        f.write(table)
