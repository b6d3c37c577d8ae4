"""`--help` of the two trainers: the config's sections and its most used keys, each with its default and meaning
as the trainer's YAML file says them (its comments are the keys' documentation; nothing here repeats them), and
where to go next. Hydra's own help stays behind `--hydra-help`."""

import re
from importlib import resources

TRAINERS = {
    "sft": ("Supervised fine-tuning of a causal language model on chat data from parquet",
            ["data.train_files", "data.val_files", "data.multiturn.enable", "data.max_length", "data.truncation", "data.train_batch_size",
             "data.micro_batch_size_per_gpu", "model.partial_pretrain", "model.enable_gradient_checkpointing", "model.lora_rank",
             "model.fsdp_config.mixed_precision.param_dtype", "optim.lr", "optim.lr_scheduler", "optim.lr_warmup_steps_ratio",
             "ulysses_sequence_parallel_size", "trainer.total_epochs", "trainer.total_training_steps", "trainer.test_freq",
             "trainer.save_freq", "trainer.default_local_dir", "trainer.logger"]),
    "grpo": ("GRPO-family reinforcement learning (and PPO with a critic) of a causal language model",
             ["data.train_files", "data.val_files", "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
              "actor_rollout_ref.model.path", "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.ppo_mini_batch_size",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_kl_loss",
              "actor_rollout_ref.actor.policy_loss.loss_mode", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
              "actor_rollout_ref.rollout.temperature", "algorithm.adv_estimator", "custom_reward_function.path",
              "trainer.total_training_steps", "trainer.test_freq", "trainer.save_freq", "trainer.default_local_dir", "trainer.logger"]),
}
KEY_LINE = re.compile(r"^(\s*)([A-Za-z_]\w*):\s*([^#]*?)\s*(?:#\s?(.*))?$")
WIDTH = 118
KEY_COLUMN = 44


def documented_keys(yaml_text: str) -> dict[str, tuple[str, str]]:
    """Every key path of a YAML file of this package, with its default as written and its comment: the comment
    lines just above the key and the one after its value, with that one's continuation lines (comment lines
    indented deeper than the key, under a key line that ended with a comment)."""
    keys: dict[str, tuple[str, str]] = {}
    parents: list[tuple[int, str]] = []
    above: list[str] = []
    last: tuple[int, str] | None = None  # the indentation and path of the latest key with a comment after its value
    for line in yaml_text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped:
            above, last = [], None
        elif stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if last is not None and indent > last[0] and not above:
                default, comment = keys[last[1]]
                keys[last[1]] = (default, f"{comment} {text}")
            else:
                above.append(text)
                last = None
        elif match := KEY_LINE.match(line):
            while parents and parents[-1][0] >= indent:
                parents.pop()
            path = ".".join([*(name for _, name in parents), match[2]])
            keys[path] = (match[3], " ".join([*above, match[4] or ""]).strip())
            parents.append((indent, match[2]))
            above, last = [], (indent, path) if match[4] else None
    return keys


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def trainer_help(trainer: str) -> str:
    """The text `python -m fsdptrain.{trainer}_trainer --help` prints."""
    what, most_used = TRAINERS[trainer]
    yaml_name = f"{trainer}_trainer.yaml"
    keys = documented_keys(resources.files("fsdptrain.config").joinpath(yaml_name).read_text())
    sections = [k for k in keys if "." not in k and k not in ("defaults", "hydra")]
    module = f"fsdptrain.{trainer}_trainer"
    lines = [f"usage: torchrun --nproc_per_node=N -m {module} key=value ...",
             f"   or: python -m {module} trainer.n_gpus_per_node=N key=value ...   (starts its N workers itself)",
             f"{what};", "FSDP2, configured with Hydra, with verl's key names (verl's own scripts load as written).", "",
             "sections (every key, its default and meaning: fsdptrain/config/" + yaml_name + "):"]
    name_width = max(map(len, sections)) + 2
    for section in sections:
        default, comment = keys[section]
        lines.append(clip(f"  {section:<{name_width}}{comment}" + (f" (default {default})" if default else ""), WIDTH))
    lines += ["", "most used keys, by section (key=default, meaning):"]
    width = min(max(len(f"{key.split('.', 1)[-1]}={keys[key][0]}") for key in most_used) + 2, KEY_COLUMN)
    section = None
    for key in most_used:
        head, _, rest = key.partition(".")
        if rest and head != section:
            lines.append(f"  {head}.")
        section = head if rest else None
        assignment = f"{rest or key}={keys[key][0]}"
        lines.append(clip(f"    {assignment:<{width}}  {keys[key][1]}" if rest else f"  {assignment:<{width + 2}}  {keys[key][1]}", WIDTH))
    lines += ["", f"before a run:  python -m fsdptrain.check {trainer} --nproc-per-node N key=value ...",
              "               reads the command line, the data (every row) and the model folder as the trainer would, on any",
              "               machine, and prints the run's sizes; exit 0 only if it would start",
              f"docs:          docs/{trainer}.md, docs/from_verl.md (verl's keys); the resolved config: python -m {module} --cfg job key=value ...",
              "Hydra's own help: --hydra-help"]
    return "\n".join(lines)
