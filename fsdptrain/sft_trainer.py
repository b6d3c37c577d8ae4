"""`torchrun -m fsdptrain.sft_trainer key=value ...`: supervised fine-tuning."""

import hydra
from omegaconf import DictConfig

from fsdptrain.config.sft import load_sft_config
from fsdptrain.trainer.sft import run_sft


@hydra.main(config_path="config", config_name="sft_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_sft(load_sft_config(cfg))


if __name__ == "__main__":
    main()
