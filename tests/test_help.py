"""Each trainer's --help and check's: short, from the YAML's own comments, naming `fsdptrain.check`."""

import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from fsdptrain.config.help import TRAINERS, documented_keys

from conftest import REPO


@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_trainer_help_is_short_and_points_to_check(trainer):
    shown = subprocess.run([sys.executable, "-m", f"fsdptrain.{trainer}_trainer", "--help"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert len(shown) < 60
    assert any(f"python -m fsdptrain.check {trainer}" in line for line in shown)
    assert not any("Configuration groups" in line or "== Config ==" in line for line in shown)  # not Hydra's dump
    assert any(line.strip().startswith("train_files=???") for line in shown)


@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_help_reads_every_key_default_and_meaning_from_the_yaml(trainer):
    """The parser of the YAML's comments finds every key Hydra composes, with the default Hydra reads, and each key
    that --help lists has a meaning written beside it."""
    text = (REPO / "fsdptrain" / "config" / f"{trainer}_trainer.yaml").read_text()
    keys = documented_keys(text)
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        composed = OmegaConf.to_container(compose(config_name=f"{trainer}_trainer"), resolve=False)

    def leaves(node, prefix=""):
        for name, value in node.items():
            path = f"{prefix}{name}"
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{path}.")
            else:
                yield path, value

    for path, value in leaves(composed):
        assert path in keys, path
        assert yaml.safe_load(f"v: {keys[path][0]}")["v"] == value, (path, keys[path][0], value)
    for key in TRAINERS[trainer][1]:
        assert keys[key][1], f"{key} has no comment in {trainer}_trainer.yaml for --help to show"
    # a continuation line of a comment belongs to its key, not to the next
    assert "memory, each layer copied" in keys["actor_rollout_ref.actor.fsdp_config.cpu_offload" if trainer == "grpo" else "model.fsdp_config.cpu_offload"][1]


def test_check_help_names_the_trainers_help_and_the_docs():
    shown = subprocess.run([sys.executable, "-m", "fsdptrain.check", "--help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert len(shown.splitlines()) < 60
    assert "python -m fsdptrain.grpo_trainer --help" in shown and "docs/" in shown
