"""`torchrun -m fsdptrain.grpo_trainer key=value ...` (or `python -m fsdptrain.grpo_trainer trainer.n_gpus_per_node=N ...`):
GRPO-family reinforcement learning."""

import sys

import hydra
from omegaconf import DictConfig

from fsdptrain.config.help import trainer_help
from fsdptrain.config.verl_keys import translate_argv

# torch and transformers are imported inside what needs them, below, so that --help answers at once.
command_line_problems: list[str] = []  # verl keys it cannot take, reported with the config's own problems


@hydra.main(config_path="config", config_name="grpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from fsdptrain.distributed.mesh import world_from_environment
    from fsdptrain.trainer.grpo import run_grpo
    from fsdptrain.trainer.grpo_plan import read_grpo_config, resolve_grpo
    from fsdptrain.trainer.report import user_errors_reported

    with user_errors_reported():
        config = read_grpo_config(cfg, command_line_problems)
        run_grpo(*resolve_grpo(config, world_from_environment(config.trainer.device)))


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(trainer_help("grpo"))
        sys.exit(0)
    from fsdptrain.distributed.spawn import launch_workers_if_asked
    from fsdptrain.trainer.report import exit_without_teardown, user_errors_reported

    if (exit_code := launch_workers_if_asked("fsdptrain.grpo_trainer", sys.argv[1:])) is not None:
        exit_without_teardown(exit_code)
    with user_errors_reported():
        sys.argv, command_line_problems = translate_argv(sys.argv, "grpo")
    main()
    exit_without_teardown(0)
