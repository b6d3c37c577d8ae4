"""verl's command lines, read as verl reads them: before Hydra sees the overrides, every `key=value` is checked
against fsdptrain's YAML and verl_keys.yaml. A key fsdptrain knows passes; a key verl names otherwise is renamed;
one that changes nothing here is taken and logged once with its reason; one for a feature not built is refused
with what to use instead; a value verl names otherwise (an engine's name) is renamed, logged; and every key that is none of these is reported, all in one error, each with the
closest known key.
"""

import difflib
import os
import sys
from typing import Any

import yaml
from omegaconf import OmegaConf

from fsdptrain.config.base import defaults

TABLE = os.path.join(os.path.dirname(__file__), "verl_keys.yaml")


def verl_table(trainer: str) -> dict[str, dict[str, Any]]:
    """verl_keys.yaml's entries for `trainer` (sft or grpo)."""
    with open(TABLE) as f:
        return yaml.safe_load(f)[trainer]


def known_keys(trainer: str) -> tuple[set[str], set[str]]:
    """The dotted keys of the trainer's YAML: its leaves, and the leaves that take a mapping of any keys."""
    leaves, open_mappings = set(), set()

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, f"{path}.")
            else:
                leaves.add(path)
                if isinstance(value, dict):
                    open_mappings.add(path)

    config = OmegaConf.to_container(defaults(f"{trainer}_trainer"))
    walk({k: v for k, v in config.items() if k not in ("defaults", "hydra")}, "")
    return leaves, open_mappings


def entry_of(key: str, table: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The table's entry for `key` or for the nearest key above it."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in table:
            return table[".".join(parts[:end])]
    return None


def hydra_value(text: str) -> Any:
    """An override's value as Hydra reads it (YAML: `0`, `null`, `sync`), or the text itself where it is not YAML."""
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


def off_values(entry: dict[str, Any]) -> list[Any]:
    """The values of a refused key that ask for nothing unbuilt (`unless`: one value or a list)."""
    return entry["unless"] if isinstance(entry["unless"], list) else [entry["unless"]]


def note(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"fsdptrain: {message}", file=sys.stderr)


def translate(overrides: list[str], trainer: str, world_size: int) -> tuple[list[str], list[str]]:
    """The overrides as fsdptrain takes them, and the problems of those it cannot take (unknown keys with the
    closest known one, refused keys with what to use instead, a launch shape that is not the world's): the config's
    loading reports them with its own, all in one error."""
    leaves, open_mappings = known_keys(trainer)
    table = verl_table(trainer)
    kept, problems, shape = [], [], {}
    for override in overrides:
        key, sep, value = override.partition("=")
        key = key.lstrip("+")  # verl's scripts add keys its own schema lacks with `+key=`; here every key is checked alike
        if not sep or key.startswith(("~", "hydra.", "-")):
            kept.append(override)
            continue
        entry = entry_of(key, table)
        renames = {str(k): v for k, v in (entry or {}).get("values", {}).items()}  # by text: a value may be a mapping ({})
        renamed = renames.get(str(hydra_value(value)))
        if renamed is not None:
            note(f"{key}={value} is {key}={renamed} here: {' '.join(str(entry['reason']).split())}")
            kept.append(f"{key}={renamed}")
            continue
        if key in leaves or any(leaf.startswith(key + ".") for leaf in leaves) or any(key.startswith(m + ".") for m in open_mappings):
            kept.append(f"{key}={value}")
            continue
        if entry is None:
            close = difflib.get_close_matches(key, sorted(leaves), n=1, cutoff=0.6)
            problems.append(f"{key}: not a key of fsdptrain's {trainer}_trainer.yaml" + (f" (did you mean {close[0]}?)" if close else ""))
        elif "mapped" in entry:
            note(f"verl's {key} is fsdptrain's {entry['mapped']}")
            kept.append(f"{entry['mapped']}={value}")
        elif "accepted" in entry:
            note(f"{key}={value} changes nothing here: {' '.join(str(entry['accepted']).split())}")
        elif "refused" in entry and ("unless" not in entry or hydra_value(value) not in off_values(entry)):
            problems.append(f"{key}={value}: {' '.join(str(entry['refused']).split())}")
        elif entry.get("world_size"):
            shape[key.rsplit(".", 1)[1]] = hydra_value(value)
    if "nnodes" in shape or "n_gpus_per_node" in shape:
        nodes, per_node = shape.get("nnodes", 1), shape.get("n_gpus_per_node", world_size)
        if not (isinstance(nodes, int) and isinstance(per_node, int)) or nodes * per_node != world_size:
            problems.append(f"trainer.nnodes ({nodes}) x trainer.n_gpus_per_node ({per_node}) must equal the number of processes "
                            f"torchrun started ({world_size}): launch with --nnodes={nodes} --nproc_per_node={per_node}, or fix the keys")
    return kept, problems


def translate_argv(argv: list[str], trainer: str) -> tuple[list[str], list[str]]:
    """sys.argv with its overrides translated (`translate`) for an entry point to hand to Hydra, and the problems
    for the config's loading to report."""
    overrides, problems = translate(argv[1:], trainer, int(os.environ.get("WORLD_SIZE", "1")))
    return [argv[0], *overrides], problems
