"""`torchrun -m fsdptrain.grpo_trainer key=value ...`: GRPO-family reinforcement learning."""

import sys

import hydra
from omegaconf import DictConfig

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.config.verl_keys import translate_argv
from fsdptrain.trainer.grpo import run_grpo

command_line_problems: list[str] = []  # verl keys it cannot take, reported with the config's own problems


@hydra.main(config_path="config", config_name="grpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_grpo(load_grpo_config(cfg, command_line_problems))


if __name__ == "__main__":
    sys.argv, command_line_problems = translate_argv(sys.argv, "grpo")
    main()
