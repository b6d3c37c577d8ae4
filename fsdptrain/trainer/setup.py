"""What every trainer sets up the same way: the process group, the trained model with its optimizer and schedule,
frozen models, the checkpoint manager, the logger and the progress bar. Each trainer calls these with the
sections of its own config."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdptrain.checkpoint.manager import CheckpointManager, Stateful
from fsdptrain.config.schema import FSDPConfig, ModelConfig, OptimConfig, TrainerConfig
from fsdptrain.distributed.mesh import Parallel, init_parallel
from fsdptrain.logging.metrics import MetricLogger, progress_bar
from fsdptrain.models.loading import build_model
from fsdptrain.trainer.optim import build_optimizer, build_scheduler
from fsdptrain.trainer.runtime import apply_cpu_speedups, quiet_non_main, seed_everything


def start_run(trainer: TrainerConfig, sp_size: int) -> Parallel:
    """Join the process group (dp x sp mesh), quiet the other ranks' library output, seed every generator."""
    parallel = init_parallel(trainer.device, sp_size)
    quiet_non_main(parallel)
    seed_everything(trainer.seed)
    return parallel


def build_sharded_model(
    path: str,
    model: ModelConfig,
    fsdp: FSDPConfig,
    hf_config: PretrainedConfig,
    trainer: TrainerConfig,
    parallel: Parallel,
    packed: bool,
    trainable: bool,
) -> nn.Module:
    """A sharded model (trained or frozen) with the CPU speed-ups that `trainer.cpu_speedups` switches on."""
    sharded = build_model(path, model, fsdp, hf_config, parallel, packed, trainable)
    host_memory = parallel.device.type == "cpu" or fsdp.cpu_offload
    apply_cpu_speedups(sharded, trainer.cpu_speedups, parallel, host_memory)
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
    bar: tqdm
    step: int  # the last completed step: 0, or the resumed checkpoint's

    def finish(self, shutdown: Callable[[], None] | None = None) -> None:
        """Close the bar and loggers; `shutdown` (a rollout engine's) runs after the last collective, and may
        tear the process group down itself."""
        self.bar.close()
        self.logger.close()
        dist.barrier()
        if shutdown is not None:
            shutdown()
        # Left to interpreter exit, gloo's threads can be torn down while still joinable: an abort after a finished run.
        if dist.is_initialized():
            dist.destroy_process_group()


def open_run(
    parallel: Parallel,
    trainer: TrainerConfig,
    path: str,
    model: ModelConfig,
    fsdp: FSDPConfig,
    optim: OptimConfig,
    hf_config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    packed: bool,
    total_steps: int,
    run_config: dict,
    states: dict[str, Stateful] | None = None,
) -> Run:
    """Build the trained model, its optimizer and LR schedule, resume the checkpoint that trainer.resume_mode
    selects (with the trainer's own `states` beside the scheduler), and open the logger and progress bar."""
    trained = build_sharded_model(path, model, fsdp, hf_config, trainer, parallel, packed, trainable=True)
    optimizer = build_optimizer(trained, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    checkpoints = CheckpointManager(
        trainer, parallel, trained, optimizer, tokenizer, fsdp.model_dtype, {"scheduler": scheduler, **(states or {})}, run_config
    )
    step = checkpoints.resume()
    logger = MetricLogger(
        trainer.logger, trainer.default_local_dir, trainer.project_name, trainer.experiment_name, run_config,
        parallel.is_main, resume_step=step,
    )
    trained.train()
    return Run(parallel, trained, optimizer, scheduler, checkpoints, logger, progress_bar(total_steps, step, parallel.is_main), step)
