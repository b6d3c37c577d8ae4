"""`torchrun -m fsdptrain.grpo_trainer key=value ...`: GRPO-family reinforcement learning."""

import hydra
from omegaconf import DictConfig

from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.trainer.grpo import run_grpo


@hydra.main(config_path="config", config_name="grpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_grpo(load_grpo_config(cfg))


if __name__ == "__main__":
    main()
