"""The SFT trainer's plan: the config and the world turned, before the process group starts, into what the run
builds and the sizes the step takes, with the rules that need the number of ranks; every problem in one error.
Nothing below reads the config: the run takes the plan."""

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from omegaconf import DictConfig

from fsdptrain.config.base import check_packages, read_config
from fsdptrain.config.sft import DataConfig, SFTConfig, SFTTrainerConfig, own_checks
from fsdptrain.config.shared import logger_packages
from fsdptrain.data.micro_batches import MicroBatching, check_batch_layout, validate_micro_batching
from fsdptrain.distributed.mesh import World, check_fsdp_size, check_sp_divides_world, world_from_environment
from fsdptrain.dtypes import warn_if_emulated
from fsdptrain.trainer.setup import ModelSpec


@dataclass(frozen=True)
class SFTPlan:
    model: ModelSpec  # model.partial_pretrain, trained (packed: use_remove_padding)
    trainer: SFTTrainerConfig
    data: DataConfig
    sp_size: int  # ulysses_sequence_parallel_size
    run_config: dict  # the whole config, as checkpoints and loggers record it
    micro_batching: MicroBatching
    chunked_loss_tokens: int
    balance_dp_token: bool  # every loss token of a step weighs 1 / its global count (else verl's per-micro-batch means)
    clip_grad: float


def micro_batching(config: SFTConfig) -> MicroBatching:
    """data.use_dynamic_bsz=null: a token budget of micro_batch_size_per_gpu x max_length (no micro-batch holds
    more tokens than the count-based one could) where the cut cannot change the loss, else a sample count."""
    data = config.data
    dynamic, max_tokens = data.use_dynamic_bsz, data.max_token_len_per_gpu
    if dynamic is None:
        dynamic = config.use_remove_padding and data.balance_dp_token
        if dynamic and max_tokens is None:
            max_tokens = data.micro_batch_size_per_gpu * data.max_length
    return MicroBatching(data.micro_batch_size_per_gpu, dynamic, max_tokens, "data.micro_batch_size_per_gpu", "data.use_dynamic_bsz",
                         "data.max_token_len_per_gpu")


def plan_checks(config: SFTConfig, world: World) -> list[Callable[[], None]]:
    """The rules the config's own checks cannot make: the micro-batches' sizes and the world's, and (on the run's own
    machine) the packages its loggers import."""
    batching, sp = micro_batching(config), config.ulysses_sequence_parallel_size
    return [lambda: validate_micro_batching(batching, config.data.max_length, "data.max_length"), lambda: check_sp_divides_world(sp, world.world_size),
            lambda: check_fsdp_size(config.model.fsdp_config.fsdp_size, world.world_size, "model.fsdp_config.fsdp_size"),
            lambda: check_batch_layout(config.data.train_batch_size, "data.train_batch_size", batching, world.world_size // sp),
            *([lambda: check_packages(logger_packages(config.trainer))] if world.here else [])]


def read_sft_config(cfg: DictConfig, problems: Sequence[str] = (), world: World | None = None) -> SFTConfig:
    """The config as the trainer reads it, before any work starts: typed, then each section's own checks and the
    plan's (against `world`, by default torchrun's), every problem with the command line's `problems` in one
    ConfigError."""
    config: SFTConfig = read_config(cfg, SFTConfig, problems, own_checks,
                                    lambda typed: plan_checks(typed, world or world_from_environment(typed.trainer.device)))
    world = world or world_from_environment(config.trainer.device)
    if world.rank == 0:
        warn_if_emulated(config.model.fsdp_config.mixed_precision.param_dtype, "model.fsdp_config.mixed_precision.param_dtype", world.device)
    return config


def plan_sft(config: SFTConfig) -> SFTPlan:
    """The run's plan, from a config that `read_sft_config` has checked."""
    model = config.model
    spec = ModelSpec(model.partial_pretrain, model, model.fsdp_config, config.use_remove_padding, config.optim, model.lora("model"))
    return SFTPlan(spec, config.trainer, config.data, config.ulysses_sequence_parallel_size, asdict(config), micro_batching(config),
                   model.chunked_loss_tokens, config.data.balance_dp_token, config.optim.clip_grad)
