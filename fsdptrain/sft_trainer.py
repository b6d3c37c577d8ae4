"""`torchrun -m fsdptrain.sft_trainer key=value ...` (or `python -m fsdptrain.sft_trainer trainer.n_gpus_per_node=N ...`): supervised fine-tuning."""

import sys

import hydra
from omegaconf import DictConfig

from fsdptrain.config.help import trainer_help
from fsdptrain.config.verl_keys import translate_argv

# torch and transformers are imported inside what needs them, below, so that --help answers at once.
command_line_problems: list[str] = []  # verl keys it cannot take, reported with the config's own problems


@hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from fsdptrain.trainer.report import user_errors_reported
    from fsdptrain.trainer.sft import run_sft
    from fsdptrain.trainer.sft_plan import plan_sft, read_sft_config

    with user_errors_reported():
        run_sft(plan_sft(read_sft_config(cfg, command_line_problems)))


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(trainer_help("sft"))
        sys.exit(0)
    from fsdptrain.distributed.spawn import launch_workers_if_asked
    from fsdptrain.trainer.report import exit_without_teardown, user_errors_reported

    if (exit_code := launch_workers_if_asked("fsdptrain.sft_trainer", sys.argv[1:])) is not None:
        exit_without_teardown(exit_code)
    with user_errors_reported():
        sys.argv, command_line_problems = translate_argv(sys.argv, "sft")
    main()
    exit_without_teardown(0)
