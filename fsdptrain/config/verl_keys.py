"""verl's command lines, read as verl reads them: before Hydra sees the overrides, every `key=value` is checked
against fsdptrain's YAML and verl_keys.yaml. A key fsdptrain knows passes; a key verl names otherwise is renamed;
one that changes nothing here is taken and logged once with its reason; one for a feature not built is refused
with what to use instead; a value verl names otherwise (an engine's name) is renamed, logged; and every key that is none of these is reported, all in one error, each with the
closest known key.
"""

import difflib
import importlib
import os
import sys
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdptrain.config.base import defaults, raise_problems

TABLE = os.path.join(os.path.dirname(__file__), "verl_keys.yaml")
DEFAULTS = os.path.join(os.path.dirname(__file__), "verl_defaults.yaml")  # the shared keys whose default is not verl's


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


def entry_name(key: str, table: dict[str, dict[str, Any]]) -> str | None:
    """The table's name for `key`'s entry: `key` itself or the nearest key above it; at each level a key of the
    table itself comes before a pattern, whose `*` stands for any one part (`*.profiler` for
    actor_rollout_ref.actor.profiler)."""
    parts = key.split(".")
    patterns = [(name, name.split(".")) for name in table if "*" in name]
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in table and (end == len(parts) or "group" not in table[name]):
            return name
        for name, pattern in patterns:
            if len(pattern) == end and all(p in ("*", part) for p, part in zip(pattern, parts)):
                return name
    return None


def entry_of(key: str, table: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    name = entry_name(key, table)
    return None if name is None else table[name]


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


def classify(override: str, trainer: str, leaves: set[str], open_mappings: set[str], table: dict[str, dict[str, Any]]) -> tuple[str, str, str | None]:
    """One command-line override's state: (state, what it means here, the override as Hydra takes it or None).
    States: `key` (fsdptrain's own key), `value renamed`, `mapped`, `accepted` (changes nothing here), `refused`,
    `left off` (a refused key at a value that asks for nothing unbuilt), `launch shape` (checked against the
    world), `unknown`, `passed` (not a key=value: Hydra's own syntax)."""
    key, sep, value = override.partition("=")
    key = key.lstrip("+")  # verl's scripts add keys its own schema lacks with `+key=`; here every key is checked alike
    if key.startswith("~"):
        return deletion(key[1:], trainer, leaves, open_mappings, table)
    if not sep or key.startswith(("hydra.", "hydra/", "-")):  # Hydra's own settings and config groups
        return "passed", "", override
    entry = entry_of(key, table)
    renames = {str(k): v for k, v in (entry or {}).get("values", {}).items()}  # by text: a value may be a mapping ({})
    renamed = renames.get(str(hydra_value(value)))
    if renamed is not None:
        return "value renamed", f"{key}={value} is {key}={renamed} here: {' '.join(str(entry['reason']).split())}", f"{key}={renamed}"
    if entry is not None and "group" in entry:  # `model=hf_model`: verl's config group that this section is
        if hydra_value(value) == entry["group"]:
            return "accepted", f"changes nothing here: verl's config group {key}={entry['group']} is fsdptrain's {key} section", None
        return "refused", " ".join(str(entry["refused"]).split()), None
    known_section = key not in table and any(leaf.startswith(key + ".") for leaf in leaves)  # `optim=fsdp` picks verl's config group
    if key in leaves or known_section:
        return "key", "", f"{key}={value}"
    if any(key.startswith(m + ".") for m in open_mappings):  # a new key of a mapping (verl's `+`): Hydra adds it, or sets it if present
        return "key", "", f"++{key}={value}"
    if entry is None:
        return unknown(key, trainer, leaves)
    if "mapped" in entry:
        return "mapped", f"verl's {key} is fsdptrain's {entry['mapped']}", f"{entry['mapped']}={value}"
    if "accepted" in entry:
        return "accepted", f"changes nothing here: {' '.join(str(entry['accepted']).split())}", None
    if "refused" in entry and ("unless" not in entry or hydra_value(value) not in off_values(entry)):
        return "refused", " ".join(str(entry["refused"]).split()), None
    if entry.get("world_size"):
        return "launch shape", "checked against the number of processes (without torchrun: that many workers started, one node)", None
    return "left off", "a refused feature's key, at a value that asks for nothing unbuilt", None


def deletion(key: str, trainer: str, leaves: set[str], open_mappings: set[str], table: dict[str, dict[str, Any]]) -> tuple[str, str, str | None]:
    """verl's `~key` (or `~key=value`): the key's value removed, so that the code's own default applies. Here a key
    of a mapping that takes any keys is removed from it; a key that may be null becomes null; one that may not keeps
    fsdptrain's default; a key of verl's that asks for nothing here has nothing to remove."""
    if any(key.startswith(m + ".") for m in open_mappings):
        return "key", "", f"~{key}"
    entry = entry_of(key, table)
    if key not in leaves and entry is not None and "mapped" in entry:
        key = entry["mapped"]
    if key in leaves:
        if takes_null(trainer, key):
            return "key", "", f"{key}=null"
        return "accepted", f"changes nothing here: {key} takes no null, so fsdptrain's default stays", None
    if entry is not None:
        return "accepted", "changes nothing here: the key asks for nothing built here, so there is nothing to remove", None
    return unknown(key, trainer, leaves)


def unknown(key: str, trainer: str, leaves: set[str]) -> tuple[str, str, None]:
    close = difflib.get_close_matches(key, sorted(leaves), n=1, cutoff=0.6)
    return "unknown", f"not a key of fsdptrain's {trainer}_trainer.yaml" + (f" (did you mean {close[0]}?)" if close else ""), None


def takes_null(trainer: str, key: str) -> bool:
    """Whether the trainer's schema lets `key` be null."""
    module, name = {"grpo": ("fsdptrain.config.grpo", "GRPOConfig"), "sft": ("fsdptrain.config.sft", "SFTConfig")}[trainer]
    try:
        OmegaConf.merge(OmegaConf.structured(getattr(importlib.import_module(module), name)), OmegaConf.from_dotlist([f"{key}=null"]))
    except OmegaConfBaseException:
        return False
    return True


def key_states(overrides: list[str], trainer: str) -> list[tuple[str, str, str, str | None]]:
    """Each override's (key=value, state, meaning, override for Hydra), as `classify` gives them."""
    leaves, open_mappings = known_keys(trainer)
    table = verl_table(trainer)
    return [(override, *classify(override, trainer, leaves, open_mappings, table)) for override in overrides]


CONFIG_FLAGS = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}
# verl's own trainer configs, which a script may name with --config-name (its --config-path relative to verl/trainer)
VERL_CONFIGS = {"ppo_trainer": None, "sft_trainer": None, "sft_trainer_engine": None,
                "ppo_megatron_trainer": "verl's Megatron trainer config: the Megatron engine is not built; train with FSDP (verl's ppo_trainer)"}


def config_file(args: list[str]) -> tuple[list[str], list[str], list[str], list[str]]:
    """verl's `--config-path DIR --config-name NAME` (or `-cp`, `-cn`, with `=` or not): a user's YAML in verl's
    layout (a `defaults` list naming verl's trainer config, `hydra.searchpath`, then keys), read as overrides that
    come before the command line's, so that the command line wins as in Hydra. Returns (the file's overrides, the
    other arguments, problems, an engine that is not built). A relative DIR is the working directory's, or else verl's own config folder, whose
    trainer configs are this trainer's defaults."""
    given, rest = {}, []
    items = iter(args)
    for arg in items:
        flag, sep, value = arg.partition("=")
        if flag in CONFIG_FLAGS:
            given[CONFIG_FLAGS[flag]] = value if sep else next(items, "")
        else:
            rest.append(arg)
    if "name" not in given:
        return [], rest, [] if "path" not in given else ["--config-path needs --config-name: the YAML file under it to read"], []
    name = given["name"].removesuffix(".yaml")
    path = os.path.join(given.get("path", "."), f"{name}.yaml")
    if not os.path.isfile(path):
        if name in VERL_CONFIGS and not os.path.isabs(given.get("path", "")):
            reason = VERL_CONFIGS[name]
            return [], rest, [], [f"--config-name={given['name']}: {reason}"] if reason else []
        return [], rest, [f"--config-name={given['name']}: no file {path} (--config-path={given.get('path', '')})"], []
    with open(path) as f:
        document = yaml.safe_load(f) or {}
    overrides = []
    for entry in document.pop("defaults", []):  # verl's trainer config and _self_ are the defaults here; a group picks its option
        if isinstance(entry, dict):  # `override` and `optional` say how Hydra merges the pick, which a command line makes anyway
            overrides += [f"{group.removeprefix('override ').removeprefix('optional ').strip()}={option}" for group, option in entry.items()]
    document.pop("hydra", None)

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                overrides.append(f"{prefix}{key}={override_value(value)}")

    walk(document, "")
    return overrides, rest, [], []


def override_value(value: Any) -> str:
    """A YAML value as a Hydra override's text: strings quoted unless they are plain words, lists and mappings as
    Hydra writes them."""
    if isinstance(value, list):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if text and all(c.isalnum() or c in "_-./" for c in text) and hydra_value(text) == text:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def translate(overrides: list[str], trainer: str, world_size: int) -> tuple[list[str], list[str]]:
    """The overrides as fsdptrain takes them, and the problems of those it cannot take (unknown keys with the
    closest known one, refused keys with what to use instead, a launch shape that is not the world's): the config's
    loading reports them with its own, all in one error. A command line for an engine that is not built raises
    that alone (ConfigError), in at most three lines. A user's YAML in verl's layout (--config-path, --config-name)
    comes first."""
    from_file, overrides, problems, engines = config_file(overrides)
    overrides = [*from_file, *overrides]
    kept, shape, implied = [], {}, {}
    refused: dict[str, list[tuple[str, str]]] = {}  # by reason: (the table's entry, key=value) of each refused override
    table = verl_table(trainer)
    for override, state, meaning, taken in key_states(overrides, trainer):
        key, _, value = override.partition("=")
        key = key.lstrip("+")
        if taken is not None:
            kept.append(taken)
        if state in ("mapped", "accepted", "left off"):
            for implication in (entry_of(key, table) or {}).get("implies", []):
                implied.setdefault(implication.partition("=")[0], (implication, key))
        if state in ("value renamed", "mapped"):
            note(meaning)
        elif state == "accepted":
            note(f"{override if key.startswith('~') else f'{key}={value}'} {meaning}")
        elif state == "unknown":
            problems.append(f"{key}: {meaning}")
        elif state == "refused":
            refused.setdefault(meaning, []).append((entry_name(key, table), f"{key}={value}"))
        elif state == "launch shape":
            shape[key.rsplit(".", 1)[1]] = hydra_value(value)
    # a command line for an engine that is not built: that alone is its problem
    for meaning, overrides in refused.items():  # a refused backend's dozen keys are one problem, not a dozen
        names = sorted({name for name, _ in overrides})
        line = f"{overrides[0][1]}: {meaning}" if len(overrides) == 1 else f"{', '.join(names)} ({len(overrides)} keys): {meaning}"
        (engines if any(table[name].get("engine") for name in names) else problems).append(line)
    given = {taken.partition("=")[0].lstrip("+") for taken in kept}
    for target, (implication, because) in implied.items():
        if target not in given:  # an explicit value wins
            kept.append(implication)
            note(f"{because} is verl's new layout's: {implication}")
    rollout = rollout_shape(kept)
    if rollout.get("nnodes") and "n_gpus_per_node" not in rollout and "n_gpus_per_node" in shape:  # verl's default: the trainer's
        kept.append(f"{ROLLOUT_SHAPE}.n_gpus_per_node={shape['n_gpus_per_node']}")
        rollout["n_gpus_per_node"] = shape["n_gpus_per_node"]
    rollout_ranks = rollout.get("nnodes", 0) * rollout.get("n_gpus_per_node", 0) if all(isinstance(v, int) for v in rollout.values()) else 0
    if "nnodes" in shape or "n_gpus_per_node" in shape:
        training = world_size - rollout_ranks
        nodes, per_node = shape.get("nnodes", 1), shape.get("n_gpus_per_node", training)
        if not (isinstance(nodes, int) and isinstance(per_node, int)) or nodes * per_node != training:
            launch = f"--nnodes={nodes} --nproc_per_node={per_node}" if not rollout_ranks else f"{nodes * per_node} + {rollout_ranks} processes"
            rollout_part = f" less the {rollout_ranks} rollout ranks ({ROLLOUT_SHAPE}.nnodes x n_gpus_per_node)" if rollout_ranks else ""
            problems.append(f"trainer.nnodes ({nodes}) x trainer.n_gpus_per_node ({per_node}) must equal the number of processes "
                            f"torchrun started ({world_size}){rollout_part}: launch with {launch}, or fix the keys")
    if engines:  # told alone, before any config is read: the rest of the command line follows from the engine
        if problems:
            engines.append(f"({len(problems)} other problem(s) of this command line left out: they follow from the engine it asks for)")
        raise_problems(engines)
    return kept, problems


ROLLOUT_SHAPE = "actor_rollout_ref.rollout"


def rollout_shape(overrides: list[str]) -> dict[str, Any]:
    """The standalone rollout ranks' nnodes and n_gpus_per_node as `overrides` set them (separate_async)."""
    shape = {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") in (f"{ROLLOUT_SHAPE}.nnodes", f"{ROLLOUT_SHAPE}.n_gpus_per_node"):
            shape[key.rsplit(".", 1)[1]] = hydra_value(value)
    return shape


def translate_argv(argv: list[str], trainer: str) -> tuple[list[str], list[str]]:
    """sys.argv with its overrides translated (`translate`) for an entry point to hand to Hydra, and the problems
    for the config's loading to report."""
    overrides, problems = translate(argv[1:], trainer, int(os.environ.get("WORLD_SIZE", "1")))
    return [argv[0], *overrides], problems


def default_differences(trainer: str, overrides: list[str]) -> list[str]:
    """The defaults that are not verl 0.9's and can change a verl script's run (verl_defaults.yaml, where each
    says why), of the keys `overrides` leave unset: `key=here (verl: verl's)`, one a line."""
    with open(DEFAULTS) as f:
        table = yaml.safe_load(f)[trainer]
    given = {override.partition("=")[0].lstrip("+") for override in overrides}
    ours = OmegaConf.to_container(defaults(f"{trainer}_trainer"))
    lines = []
    for key, entry in table.items():
        if not entry.get("quiet") and key not in given:
            value = ours
            for part in key.split("."):
                value = value[part]
            lines.append(f"{key}={value} (verl: {entry['verl']})")
    return lines
