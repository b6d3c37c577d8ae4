"""What every trainer sets up and runs the same way: the process group, the trained model with its optimizer and
schedule, frozen models, the checkpoint manager, the logger and the progress bar; the number of steps, the timing
of a step's phases, and what happens at the end of a step (log, bar, checkpoint at trainer.save_freq). Each
trainer calls these with the sections of its own config."""

import os
import re
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.checkpoint.manager import CheckpointManager, Stateful
from fsdptrain.checkpoint.run_lock import lock_run_directory, release_run_directory
from fsdptrain.config.shared import FSDPConfig, LanguageModelConfig, LoRASettings, ModelConfig, OptimConfig, TrainerConfig
from fsdptrain.distributed.launcher import die_with_launcher, fault_point
from fsdptrain.distributed.mesh import Parallel, init_parallel
from fsdptrain.distributed.roll_call import STALE_S, roll_call, start_heartbeat, stop_heartbeat
from fsdptrain.errors import ConfigError, LostRankError
from fsdptrain.logging.metrics import MetricLogger, StepLines, progress_bar
from fsdptrain.models.added_tokens import AddedTokens, TrainedRows
from fsdptrain.models.liger import apply_liger_kernels
from fsdptrain.models.loading import build_model
from fsdptrain.models.lora import for_model
from fsdptrain.optim import build_optimizer, build_scheduler
from fsdptrain.trainer.runtime import announce_once, apply_cpu_speedups, quiet_non_main, seed_everything


def start_run(trainer: TrainerConfig, sp_size: int, timeout_s: float = 1800, rollout_ranks: int = 0) -> Parallel:
    """Join the process group (dp x sp mesh over the training ranks, all but the last `rollout_ranks`; collectives
    wait `timeout_s` for every rank), die with torchrun's launcher, quiet the other ranks' library output, seed
    every generator."""
    die_with_launcher()
    parallel = init_parallel(trainer.device, sp_size, timeout_s, rollout_ranks)
    start_heartbeat(parallel.rank, parallel.world_size + parallel.rollout_ranks)
    quiet_non_main(parallel)
    seed_everything(trainer.seed)
    return parallel


def claim_run_directory(trainer: TrainerConfig, parallel: Parallel) -> None:
    """This run's lock on trainer.default_local_dir (one writer per directory), taken by rank 0; every rank raises
    the same error, naming the run that holds it, where it cannot be had."""
    refusal = [None]
    if parallel.is_main:
        try:
            lock_run_directory(trainer.default_local_dir)
        except ConfigError as e:
            refusal = [str(e)]
    dist.broadcast_object_list(refusal, src=0, group=parallel.group)
    if refusal[0] is not None:
        raise ConfigError(refusal[0])


def count_steps(trainer: TrainerConfig, dataset_size: int, batch_size: int, what: str) -> int:
    """trainer.total_training_steps, or total_epochs of whole batches of the `dataset_size` training `what`."""
    steps_per_epoch = dataset_size // batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"data.train_batch_size ({batch_size}) exceeds the {dataset_size} training {what}")
    return trainer.total_training_steps or trainer.total_epochs * steps_per_epoch


def build_sharded_model(
    path: str,
    model: ModelConfig,
    fsdp: FSDPConfig,
    hf_config: PretrainedConfig,
    trainer: TrainerConfig,
    parallel: Parallel,
    packed: bool,
    trainable: bool,
    auto_class: type = AutoModelForCausalLM,
    lora: LoRASettings | None = None,
    added: AddedTokens | None = None,
) -> nn.Module:
    """A sharded model (trained or frozen; a causal LM, or what `auto_class` builds; with `lora`, its adapters
    trained; with `added` tokens, its token matrices grown) with liger's kernels where a language model's
    `use_liger` asks for them, and the CPU speed-ups that `trainer.cpu_speedups` switches on."""
    sharded = build_model(path, model, fsdp, hf_config, parallel, packed, trainable, auto_class, lora, trainer.seed, added)
    if isinstance(model, LanguageModelConfig) and model.use_liger:
        announce_once(apply_liger_kernels(sharded, parallel.device))
    host_memory = parallel.device.type == "cpu" or fsdp.cpu_offload
    apply_cpu_speedups(sharded, trainer.cpu_speedups, parallel, host_memory, parallel.sharding_mesh(fsdp.fsdp_size).size(-1))
    return sharded


@dataclass
class Run:
    """A trained model and what goes with it through a run."""

    parallel: Parallel
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    checkpoints: CheckpointManager
    logger: MetricLogger
    bar: tqdm | StepLines
    trainer: TrainerConfig
    total_steps: int
    step: int  # the last completed step: 0, or the resumed checkpoint's
    trained_rows: TrainedRows | None  # freeze_llm: the token rows that train (the optimizer step's business)

    def due(self, step: int, every: int, last_when_off: bool | None = None) -> bool:
        """Whether something done every `every` steps and at the last is done at `step`; `every` <= 0: never, or at
        the last step alone where `last_when_off` (None: as the trainer validates and saves, its last_step_when_off)."""
        if every > 0:
            return step % every == 0 or step == self.total_steps
        return (self.trainer.last_step_when_off if last_when_off is None else last_when_off) and step == self.total_steps

    def end_step(self, step: int, metrics: dict[str, float], **postfix: str) -> None:
        """Log the step's metrics, move the progress bar (showing `postfix`), and save at trainer.save_freq."""
        self.step = step
        self.logger.log(metrics, step)
        if postfix:
            self.bar.set_postfix(**postfix)
        self.bar.update(1)
        if self.due(step, self.trainer.save_freq):
            self.checkpoints.save(step)

    def finish(self, shutdown: Callable[[], None] | None = None) -> None:
        """Close the bar and loggers; `shutdown` (a rollout engine's) runs after the last collective, and may
        tear the process group down itself."""
        self.bar.close()
        self.logger.close()
        dist.barrier(group=self.parallel.group)
        if self.parallel.is_main:
            release_run_directory(self.trainer.default_local_dir)
        end_run(shutdown)


def end_run(shutdown: Callable[[], None] | None = None) -> None:
    """Leave the process group that start_run joined, once every rank is past its last collective; `shutdown` (a
    rollout engine's) runs in between, and may tear the group down itself. Left to interpreter exit, the group's
    gloo threads, or the heartbeat's store client alive when the group goes, can be torn down while still joinable:
    an abort after a finished run."""
    stop_heartbeat()
    if shutdown is not None:
        shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class ModelSpec:
    """A model the run builds, as the plan resolves it from its config sections: its folder, how it loads, how it
    shards (and what of it waits in host memory between the phases that use it: fsdp.param_offload,
    optimizer_offload), whether its batches are packed, and, trained, its optimizer and adapters."""

    path: str
    model: ModelConfig
    fsdp: FSDPConfig
    packed: bool
    optim: OptimConfig | None = None
    lora: LoRASettings | None = None


def open_run(
    parallel: Parallel,
    trainer: TrainerConfig,
    spec: ModelSpec,
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    total_steps: int,
    run_config: dict,
    states: dict[str, Stateful] | None = None,
    companions: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]] | None = None,
    added: AddedTokens | None = None,
) -> Run:
    """Build the trained model (`spec`'s; its adapters alone, if it has them), its optimizer and LR schedule, resume the
    checkpoint that trainer.resume_mode selects (with the trainer's own `states` beside the scheduler, and its
    `companions`: other models with their optimizers, or None for a model that moves untrained), and open the logger and progress bar."""
    path, model, fsdp, optim, lora = spec.path, spec.model, spec.fsdp, spec.optim, for_model(spec.lora, hf_config)
    trained = build_sharded_model(path, model, fsdp, hf_config, trainer, parallel, spec.packed, trainable=True, lora=lora, added=added)
    trained_rows = TrainedRows(trained, added.ids) if isinstance(model, LanguageModelConfig) and model.freeze_llm else None
    optimizer = build_optimizer(trained, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    checkpoints = CheckpointManager(
        trainer, parallel, trained, optimizer, tokenizer, fsdp.model_dtype, {"scheduler": scheduler, **(states or {})}, run_config,
        companions, lora, path,
    )
    step = checkpoints.resume()
    logger = MetricLogger(
        trainer.logger, trainer.default_local_dir, trainer.project_name, trainer.experiment_name, run_config,
        parallel.is_main, resume_step=step,
    )
    trained.train()
    bar = progress_bar(total_steps, step, parallel.is_main, trainer.logger)
    return Run(parallel, trained, optimizer, scheduler, checkpoints, logger, bar, trainer, total_steps, step, trained_rows)


PEER_LOST = ("timed out", "closed by peer", "reset by peer", "broken pipe", "connection refused")  # gloo's and the store's words


@contextmanager
def lost_ranks_named(run: Run, timeout_s: float, key: str) -> Iterator[None]:
    """Around the step loop: a collective that failed for a rank gone (its connection closed) or stuck (the wait
    timed out) ends the run with one message naming the step, the collective, the ranks that stopped beating
    (distributed/roll_call.py) and the timeout's key, not a transport message per rank."""
    try:
        yield
    except RuntimeError as e:
        if not any(words in str(e).lower() for words in PEER_LOST):
            raise
        where = collective_of(e)
        dist.destroy_process_group()  # its connections close: peers still waiting on this rank fail now, not at their timeout
        call = roll_call()
        transport = re.sub(r"^\[[^\]]*\]\s*", "", str(e).splitlines()[0]).split(". ")[0]  # gloo's source line and advice cut
        raise LostRankError(f"step {run.step + 1}: {where} failed: {call.describe()}. Collectives wait {timeout_s:g} s for every rank "
                            f"({key}). Transport: {transport}", call.reporter, timeout_s + 2 * STALE_S) from e


def collective_of(error: BaseException) -> str:
    """The torch.distributed call an error came from, and the project's line that made it."""
    frames = traceback.extract_tb(error.__traceback__)
    collective = next((f.name for f in reversed(frames) if f"torch{os.sep}distributed" in f.filename and not f.name.startswith("_")
                       and "wrapper" not in f.name), "a collective")
    caller = next((f for f in reversed(frames) if f"{os.sep}fsdptrain{os.sep}" in f.filename), None)
    return collective if caller is None else f"{collective} (from {caller.name}, {os.path.basename(caller.filename)}:{caller.lineno})"


@dataclass
class StepTimer:
    """Seconds of step `step`'s named phases (`with timer("gen"): ...`), and of the whole step so far. Each phase
    is also a point where the restart tests kill a worker (distributed/launcher.py's fault_point)."""

    step: int
    seconds: dict[str, float] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        fault_point(phase, self.step)
        tick = time.perf_counter()
        yield
        if torch.cuda.is_initialized():  # else a phase's queued kernels would count in the next phase that waits on them
            torch.cuda.synchronize()
        self.seconds[phase] = time.perf_counter() - tick

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
