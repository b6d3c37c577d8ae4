"""verl's command lines as verl reads them (fsdptrain/config/verl_keys.py, verl_keys.yaml): verl's own GSM8K GRPO
example script (tests/verl_examples/, unchanged) loads with no unknown key and runs two steps with only the
launcher, paths and sizes changed; every mistake of a command line is reported in one error; the launch's shape is
checked against the world size; every key of verl's ppo_trainer.yaml and sft_trainer.yaml has a state; and the
docs' table lists every key of verl_keys.yaml."""

import asyncio
import importlib.util
import os
import re
import shlex
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hydra import compose, initialize_config_module
from launch_arguments import launch_arguments
from omegaconf import OmegaConf

from fsdptrain.check import main as check_main
from fsdptrain.config.grpo import load_grpo_config
from fsdptrain.config.sft import load_sft_config
from fsdptrain.config.verl_keys import TABLE, entry_of, key_states, off_values, translate, verl_table
from fsdptrain.errors import ConfigError
from fsdptrain.rl.agent.tools import load_tools

from conftest import REPO, save_tiny_model, torchrun

EXAMPLES = Path(__file__).parent / "verl_examples"
EXAMPLE = EXAMPLES / "run_qwen3-1.7b.sh"


def script_overrides(path: Path) -> list[str]:
    """The key=value arguments of a verl launch script, as bash passes them, its `VAR=${VAR:-default}` variables at
    their defaults."""
    text = path.read_text().replace("\\\n", " ")
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}$", text, flags=re.MULTILINE))
    command = next(line for line in text.splitlines() if re.search(r"verl\.trainer\.(main_ppo|fsdp_sft_trainer|sft_trainer)\b", line))
    command = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), command)
    return [word for word in shlex.split(command) if "=" in word and not word.startswith("-")]  # not torchrun's options


def with_local(overrides: list[str], local: dict[str, object]) -> list[str]:
    """The script's overrides with the paths and sizes of `local` in place of its own."""
    kept = [o for o in overrides if o.partition("=")[0] not in local]
    return kept + [f"{key}={value}" for key, value in local.items()]


def sizes_and_paths(model: str, data: Path, out: str) -> dict[str, object]:
    return {"data.train_files": data / "rl_train.parquet", "data.val_files": data / "rl_val.parquet", "data.train_batch_size": 4,
            "data.max_prompt_length": 96, "data.max_response_length": 8, "actor_rollout_ref.model.path": model,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2,
            "actor_rollout_ref.rollout.gpu_memory_utilization": 0.1, "trainer.n_gpus_per_node": 2, "trainer.total_training_steps": 2,
            "trainer.default_local_dir": out, "trainer.device": "cpu", "trainer.test_freq": 2}


def test_verls_example_loads_with_every_key_accepted_or_mapped(tmp_path, capsys):
    overrides, problems = translate(with_local(script_overrides(EXAMPLE), sizes_and_paths("/models/x", tmp_path, str(tmp_path))), "grpo", 2)
    assert problems == []
    notes = capsys.readouterr().err
    for key in ("use_fused_kernels", "fused_kernel_options.impl_backend"):
        assert f"actor_rollout_ref.model.{key}" in notes, key
    # verl's offload between phases is fsdptrain's own key, with verl's meaning (distributed/offload.py)
    for key in ("actor_rollout_ref.actor.fsdp_config.param_offload=False", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
                "actor_rollout_ref.ref.fsdp_config.param_offload=True"):
        assert key in overrides, key
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=overrides))
    assert config.actor_rollout_ref.rollout.n == 3 and config.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"


def test_every_mistake_of_a_command_line_is_reported_at_once():
    overrides, problems = translate(["data.train_filez=a.parquet", "actor_rollout_ref.actor.ppo_mini_batchsize=8", "critic.model.lora_rank=8",
                                     "trainer.nnodes=1", "trainer.n_gpus_per_node=8", "data.truncation=middle",
                                     "actor_rollout_ref.actor.clip_ratio_c=0.5"], "grpo", world_size=2)
    assert problems == [
        "data.train_filez: not a key of fsdptrain's grpo_trainer.yaml (did you mean data.train_files?)",
        "actor_rollout_ref.actor.ppo_mini_batchsize: not a key of fsdptrain's grpo_trainer.yaml (did you mean "
        "actor_rollout_ref.actor.ppo_mini_batch_size?)",
        "critic.model.lora_rank=8: LoRA is built for the policy (actor_rollout_ref.model.lora_rank), not yet for the critic; train the critic's full weights (remove the key)",
        "trainer.nnodes (1) x trainer.n_gpus_per_node (8) must equal the number of processes torchrun started (2): launch with "
        "--nnodes=1 --nproc_per_node=8, or fix the keys",
    ]
    # The values that are wrong, with the command line's problems, in the one error the config's loading raises.
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        cfg = compose(config_name="grpo_trainer", overrides=[*overrides, "data.train_files=a.parquet", "actor_rollout_ref.model.path=/m"])
    with pytest.raises(ConfigError) as error:
        load_grpo_config(cfg, problems)
    message = str(error.value)
    assert message.startswith("6 problems:")
    assert "data.truncation must be one of error|left|right, got 'middle'" in message and "clip_ratio_c must be > 1" in message
    assert all(problem in message for problem in problems)


def test_values_of_the_wrong_type_are_reported_with_the_other_mistakes():
    overrides, problems = translate(["data.train_filez=a.parquet", "data.max_prompt_length=long", "actor_rollout_ref.rollout.n=two",
                                     "critic.model.fsdp_config.cpu_offload=maybe", "data.train_files=a.parquet",
                                     "actor_rollout_ref.model.path=/m"], "grpo", world_size=1)
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        cfg = compose(config_name="grpo_trainer", overrides=overrides)
    with pytest.raises(ConfigError) as error:
        load_grpo_config(cfg, problems)
    assert str(error.value).splitlines() == [
        "4 problems:",
        "  data.train_filez: not a key of fsdptrain's grpo_trainer.yaml (did you mean data.train_files?)",
        "  data.max_prompt_length: Value 'long' of type 'str' could not be converted to Integer",
        "  actor_rollout_ref.rollout.n: Value 'two' of type 'str' could not be converted to Integer",
        "  critic.model.fsdp_config.cpu_offload: Value 'maybe' is not a valid bool (type str)",
    ]


def test_verl_09s_default_modes_are_this_trainer():
    """verl 0.9 drives its engine as an AsyncLLM server and runs its v1 trainer in sync mode by default: both are
    what this trainer does (the v1 trainer's keys are fsdptrain's own; its modes: test_async.py)."""
    defaults = ["actor_rollout_ref.rollout.mode=async", "trainer.use_v1=true", "trainer.v1.trainer_mode=sync"]
    assert translate(defaults, "grpo", 1) == (defaults[1:], [])
    states = {override: (state, meaning) for override, state, meaning, _ in key_states(defaults, "grpo")}
    assert states["actor_rollout_ref.rollout.mode=async"][0] == "accepted"
    assert "the engine generates inside the training processes" in states["actor_rollout_ref.rollout.mode=async"][1]


def test_verl_mains_newer_spellings_are_the_same_keys():
    """verl's main branch moved SAPO's temperatures under actor.policy_loss: scripts for the next verl load here."""
    newer = ["actor_rollout_ref.actor.policy_loss.tau_pos=2.0", "actor_rollout_ref.actor.policy_loss.tau_neg=1.5"]
    assert translate(newer, "grpo", 1) == (["actor_rollout_ref.actor.tau_pos=2.0", "actor_rollout_ref.actor.tau_neg=1.5"], [])


def test_a_key_added_to_an_open_mapping_reaches_the_config_through_hydra():
    """verl's gpt-oss example adds `+data.apply_chat_template_kwargs.reasoning_effort=medium`: through Hydra's own
    compose (struct mode, as the trainers run it) the template's arguments hold it, with or without verl's `+`."""
    for given in ("+data.apply_chat_template_kwargs.reasoning_effort=medium", "data.apply_chat_template_kwargs.reasoning_effort=medium"):
        overrides, problems = translate([given, "data.train_files=x.parquet", "actor_rollout_ref.model.path=m"], "grpo", 1)
        assert problems == []
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            config = load_grpo_config(compose(config_name="grpo_trainer", overrides=overrides))
        assert config.data.apply_chat_template_kwargs == {"reasoning_effort": "medium"}


def test_verl_09s_sft_config_groups_select_what_fsdptrain_is():
    """verl 0.9's SFT layout picks its config groups on the command line (`model=hf_model engine=fsdp optim=fsdp`):
    through Hydra's compose they load as fsdptrain's own sections; another model group is refused by name."""
    overrides, problems = translate(["model=hf_model", "engine=fsdp", "optim=fsdp", "data.train_files=x.parquet", "model.partial_pretrain=/m"], "sft", 1)
    assert problems == []
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_sft_config(compose(config_name="sft_trainer", overrides=overrides))
    assert config.model.partial_pretrain == "/m" and config.data.multiturn.enable
    _, problems = translate(["model=qwen"], "sft", 1)
    assert problems == ["model=qwen: verl's SFT model config group hf_model (a Hugging Face model folder) is fsdptrain's model section; no other "
                        "group is built"]


def test_keys_added_with_a_plus_are_checked_like_the_others():
    overrides, problems = translate(["+trainer.total_training_steps=2", "++data.shuffle=false", "+data.prompt_dict_keyz=[content]"], "sft", 1)
    assert overrides == ["trainer.total_training_steps=2", "data.shuffle=false"]
    assert problems == ["data.prompt_dict_keyz: not a key of fsdptrain's sft_trainer.yaml (did you mean data.prompt_dict_keys?)"]


def test_the_launch_shape_matches_the_world_and_off_values_of_refused_keys_pass():
    assert translate(["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "critic.model.lora_rank=0", "actor_rollout_ref.rollout.mode=sync",
                      "trainer.default_hdfs_dir=null"], "grpo", 2) == ([], [])
    _, problems = translate(["critic.model.lora_rank=@5", "actor_rollout_ref.model.use_fused_kernels=`yes`"], "grpo", 1)  # not YAML: named, no crash
    assert problems == ["critic.model.lora_rank=@5: LoRA is built for the policy (actor_rollout_ref.model.lora_rank), not yet for the critic; train the critic's full weights (remove the key)"]
    _, problems = translate(["critic.ppo_micro_batch_size=64"], "grpo", 1)
    assert problems == ["critic.ppo_micro_batch_size=64: a global micro-batch size is not taken; use critic.ppo_micro_batch_size_per_gpu"]
    assert translate([f"reward_model.reward_manager={name}" for name in ("naive", "prime", "dapo")], "grpo", 1) == ([], [])
    _, problems = translate(["reward_model.reward_manager=batch"], "grpo", 1)
    assert problems and problems[0].startswith("reward_model.reward_manager=batch: verl's batch manager")
    overrides, problems = translate(["model.fsdp_config.offload_params=true", "trainer.nnodes=2"], "sft", 2)
    assert overrides == ["model.fsdp_config.cpu_offload=true"] and "trainer.nnodes (2) x trainer.n_gpus_per_node (2)" in problems[0]


@pytest.mark.parametrize("trainer, verl_yaml", [("grpo", "ppo_trainer"), ("sft", "sft_trainer")])
def test_every_key_of_verls_trainer_yaml_has_a_state(trainer, verl_yaml):
    """Each key of verl's trainer YAML is fsdptrain's own or in verl_keys.yaml, and a refused key's off value (what
    verl's scripts leave it at) loads."""
    table = verl_table(trainer)
    lines = (EXAMPLES / f"{verl_yaml}_keys.txt").read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert len(keys) > 40
    _, problems = translate([f"{key}=null" for key in keys], trainer, 1)
    assert [p for p in problems if ": not a key of" in p] == []
    for key in keys:
        entry = entry_of(key, table)
        if entry is not None and "refused" in entry and "unless" in entry:
            for value in off_values(entry):
                text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
                assert translate([f"{key}={text}"], trainer, 1)[1] == [], key


def test_verl_keys_refuse_and_rename_as_the_table_says():
    _, problems = translate(["actor_rollout_ref.actor.strategy=megatron", "data.prompt_key=question"], "grpo", 1)
    assert [p.split(":")[0] for p in problems] == ["actor_rollout_ref.actor.strategy=megatron", "data.prompt_key=question"]
    overrides, problems = translate(["actor_rollout_ref.actor.optim.warmup_style=cosine", "trainer.max_actor_ckpt_to_keep=2"], "grpo", 1)
    assert (overrides, problems) == (["actor_rollout_ref.actor.optim.lr_scheduler=cosine", "trainer.max_ckpt_to_keep=2"], [])
    overrides, problems = translate(["optim.warmup_steps_ratio=0.05", "trainer.resume_path=/ckpt"], "sft", 1)
    assert overrides == ["optim.lr_warmup_steps_ratio=0.05"] and "trainer.resume_from_path" in problems[0]
    _, problems = translate(["optim.zero_indexed_step=false"], "sft", 1)  # torchtitan's count from 1: another warm-up
    assert len(problems) == 1 and "counts optimizer steps from 0" in problems[0]
    assert translate(["optim.zero_indexed_step=true"], "sft", 1) == ([], [])


def test_mindspeed_rls_offload_keys_are_verls_offload_between_phases():
    """MindSpeed-RL's generate_config.offload_train_* mean what verl's param_offload / optimizer_offload mean here:
    the actor's parameters and optimizer state in host memory while rollouts are generated."""
    overrides, problems = translate(["generate_config.offload_train_param=true", "generate_config.offload_train_optimizer=true",
                                     "generate_config.offload_train_grad=true"], "grpo", 1)
    assert problems == []
    assert overrides == ["actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]


@pytest.mark.parametrize("trainer, keys", [("grpo", "verl-0.9.1/ppo_trainer_keys.txt"), ("sft", "verl-0.9.1/sft_trainer_keys.txt"),
                                           ("grpo", "verl-0.9.0/ppo_trainer_keys.txt"), ("sft", "verl-0.9.0/sft_trainer_keys.txt"),
                                           ("grpo", "ppo_trainer_keys.txt"), ("sft", "sft_trainer_keys.txt")])
def test_every_key_of_verls_configs_has_a_state(trainer, keys):
    """Every leaf key of verl 0.9.1's configs (the reference), of 0.9.0's and of the older ones the seed scripts were
    written for is fsdptrain's own, or mapped, accepted with its reason, refused with what to use instead, or the
    launch shape."""
    keys = [line.strip() for line in (EXAMPLES / keys).read_text().splitlines() if line.strip() and not line.startswith("#")]
    states = {key: state for key, (_, state, _, _) in zip(keys, key_states([f"{key}=1" for key in keys], trainer))}
    assert [key for key, state in states.items() if state == "unknown"] == []
    assert {"key", "mapped", "accepted", "refused"} <= set(states.values()) | {"left off"}


def test_the_docs_count_the_states_of_verl_09s_keys():
    """docs/from_verl.md's counts by state are the table's, for verl 0.9.1's keys."""
    rows = {"fsdptrain's own key": ("key",), "mapped to": ("mapped",), "accepted:": ("accepted",), "refused with": ("refused", "left off"),
            "the launch shape": ("launch shape",)}
    page = (REPO / "docs" / "from_verl.md").read_text().splitlines()
    for column, (trainer, keys) in enumerate((("grpo", "ppo_trainer_keys.txt"), ("sft", "sft_trainer_keys.txt"))):
        keys = [line.strip() for line in (EXAMPLES / "verl-0.9.1" / keys).read_text().splitlines() if line.strip() and not line.startswith("#")]
        counts = Counter(state for _, state, _, _ in key_states([f"{key}=1" for key in keys], trainer))
        for start, states in rows.items():
            (line,) = [line for line in page if line.startswith(f"| {start}")]
            assert int(line.split("|")[2 + column]) == sum(counts[s] for s in states), line


def comparable(value, key: str):
    """A default as its meaning: numbers as floats, verl's `${oc.select:KEY,default}` and relative `${.key}` as the
    plain `${KEY}` they resolve to."""
    if isinstance(value, str) and "${" in value:
        value = re.sub(r"\$\{oc\.select:([^,}]+),[^}]*\}", r"${\1}", value)
        return re.sub(r"\$\{\.([^}]+)\}", lambda m: "${" + key.rsplit(".", 1)[0] + "." + m.group(1) + "}", value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


@pytest.mark.parametrize("trainer, verl_name", [("grpo", "ppo_trainer"), ("sft", "sft_trainer")])
def test_each_default_not_verls_is_listed_with_its_reason(trainer, verl_name):
    """Every key fsdptrain shares with verl 0.9.1 (its own key, verl's meaning) takes verl's default, or
    fsdptrain/config/verl_defaults.yaml lists it with verl's default and why; no entry lists a default that is
    verl's."""
    verl = yaml.safe_load((EXAMPLES / "verl-0.9.1" / f"{verl_name}_defaults.yaml").read_text())
    ours = OmegaConf.to_container(OmegaConf.load(REPO / "fsdptrain" / "config" / f"{trainer}_trainer.yaml"))
    table = yaml.safe_load((REPO / "fsdptrain" / "config" / "verl_defaults.yaml").read_text())[trainer]
    shared = [key for key, state, _, _ in ((o.partition("=")[0], *rest) for o, *rest in key_states([f"{k}=1" for k in verl], trainer))
              if state == "key"]
    differing = set()
    for key in shared:
        value = ours
        for part in key.split("."):
            value = value[part]
        if comparable(value, key) != comparable(verl[key], key):
            differing.add(key)
            assert key in table, f"{key}: {value!r} here, {verl[key]!r} in verl 0.9, and no reason in verl_defaults.yaml"
            assert comparable(table[key]["verl"], key) == comparable(verl[key], key), key
    assert set(table) == differing, f"listed but verl's default: {sorted(set(table) - differing)}"
    assert all(entry["why"].strip() for entry in table.values())


def test_the_table_names_each_key_once():
    """A key written twice in verl_keys.yaml would silently keep only its last entry."""
    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
        assert len(keys) == len(set(keys)), sorted({k for k in keys if keys.count(k) > 1})
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    yaml.load(open(TABLE), StrictLoader)


def test_the_generated_docs_section_is_current():
    """docs/from_verl.md's table of the keys its hand-written tables leave out is what scripts/verl_keys_doc.py
    writes from the table now."""
    import verl_keys_doc

    page = verl_keys_doc.PAGE.read_text()
    head, _, rest = page.partition(verl_keys_doc.BEGIN)
    written, _, tail = rest.partition(verl_keys_doc.END)
    assert verl_keys_doc.BEGIN + written + verl_keys_doc.END == verl_keys_doc.section(head + tail), "run python scripts/verl_keys_doc.py"


V09_EXAMPLES = EXAMPLES / "verl-0.9.0" / "examples"
SP_SIZE = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"  # verl 0.9's sequence-parallel size


def fitted_sp(args: list[str]) -> dict[str, int]:
    """The script's sequence-parallel size, at most the 2 processes' (none where the script sets none)."""
    given = [int(arg.partition("=")[2]) for arg in args if arg.startswith(f"{SP_SIZE}=")]
    return {SP_SIZE: min(given[-1], 2)} if given else {}
# The FSDP scripts of verl 0.9.0's examples that ask for something not built, and the keys that say so; every
# other one loads with no problem at all. Vision-language ones load too, and stop at their model or data.
V09_REFUSED = {
    "run_minicpm_o_2_6_fsdp.sh": {"data.custom_cls"},
}


# verl 0.9.0's scripts for its other engines (Megatron, Megatron Lite, VeOmni, AutoModel; those named *_megatron_fsdp
# train with Megatron and hold a reference with FSDP), and those of them the
# stand-in cannot follow to a launch of verl's trainer.
OTHER_ENGINES = [p for p in sorted(V09_EXAMPLES.rglob("*.sh")) if re.search(r"(megatron|veomni|automodel)(_lite|_fsdp)?\.sh$", p.name)]
NOT_LAUNCHED = {"grpo_trainer/run_deepseek_v4_megatron_lite.sh": "prints where the example moved, and launches nothing",
                "sft/run_deepseek_v4_megatron_lite.sh": "launches Megatron Lite's own launcher (verl_mlite.launch)",
                "sft/run_mimo_7b_mtp_megatron.sh": "clones Megatron-LM and mbridge first"}
SCRIPT_ENV = {"INFER_BACKEND": "vllm", "HDFS_ROOT": "/hdfs", "DATA_ROOT": "/data", "RAY_DATA_HOME": "/ray", "MODEL_PATH": "/models/x",
              "ckpts_home": "/ckpts"}  # what the scripts read from the environment without a default


@pytest.mark.parametrize("script", [p for p in OTHER_ENGINES if f"{p.parent.parent.name if p.parent.parent.name == 'sft' else p.parent.name}/{p.name}"
                                    not in NOT_LAUNCHED], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_verl_09s_examples_for_other_engines_are_refused_in_three_lines_naming_the_engine(script, capsys):
    """Through `python -m fsdptrain.check`, as a user runs it first: exit 1, the engine named in at most three lines."""
    positional = ("8", "/tmp/save") if script.parent.parent.name == "sft" else ()
    module, args = launch_arguments(script, *positional, env=SCRIPT_ENV)
    assert check_main(["sft" if module == "verl.trainer.sft_trainer" else "grpo", "--nproc-per-node", "8", *args]) == 1
    problems = [line for line in capsys.readouterr().err.partition("the run would not start:\n")[2].strip().splitlines()
                if not line.endswith("problems:")]
    assert 1 <= len(problems) <= 3, problems
    assert any(engine in line for line in problems for engine in ("Megatron", "VeOmni", "AutoModel")), problems


@pytest.fixture(scope="module")
def example_inputs(tmp_path_factory, tokenizer, tiny_llama, rl_data, chat_data) -> dict[str, object]:
    """What verl 0.9.0's FSDP examples read, on this machine: the tiny model (actor, critic), a reward model, the
    arithmetic RL data, the chat SFT data."""
    from test_reward_model import save_reward_model

    return {"model": tiny_llama, "reward_model": save_reward_model(tmp_path_factory.mktemp("rm"), tokenizer), "rl_data": rl_data,
            "chat_data": chat_data, "out": str(tmp_path_factory.mktemp("out"))}


def example_locals(trainer: str, inputs: dict[str, object]) -> dict[str, object]:
    """The paths, model and sizes an example's command line takes on 2 CPU processes."""
    if trainer == "sft":
        chat = inputs["chat_data"]
        return {"data.train_files": chat["train"], "data.val_files": chat["val"], "model.path": inputs["model"], "data.train_batch_size": 8,
                "data.micro_batch_size_per_gpu": 2, "trainer.total_training_steps": 2, "trainer.device": "cpu"}
    return {**sizes_and_paths(inputs["model"], inputs["rl_data"], inputs["out"]), **EXAMPLE_SIZES,
            "actor_rollout_ref.actor.fsdp_config.fsdp_size": -1, "actor_rollout_ref.ref.fsdp_config.fsdp_size": -1,
            "critic.model.path": inputs["model"], "reward.reward_model.model_path": inputs["reward_model"],
            "reward.custom_reward_function.path": inputs["rl_data"] / "reward.py"}


@pytest.mark.parametrize("script", [p for p in sorted(V09_EXAMPLES.rglob("*.sh")) if p not in OTHER_ENGINES], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_verl_09s_fsdp_examples_pass_check(script, example_inputs, capsys):
    """Each FSDP script of verl 0.9.0's examples (grpo_trainer, ppo_trainer, sft), its arguments as bash computes
    them, through `python -m fsdptrain.check` for 2 CPU processes with only paths, model and sizes changed (Hydra's
    compose and the trainer's reading of every input included): exit 0 with no unknown key; exit 1, in at most
    three lines naming what is not built, where the script asks for something that is not. The new SFT layout's
    scripts load as multi-turn chat data, as verl's sft_trainer reads them."""
    positional = ("8", "/tmp/save") if script.parent.parent.name == "sft" else ()
    module, args = launch_arguments(script, *positional, env=SCRIPT_ENV)
    assert module in ("verl.trainer.main_ppo", "verl.trainer.sft_trainer")
    trainer = "sft" if module == "verl.trainer.sft_trainer" else "grpo"
    local = {key: value for key, value in example_locals(trainer, example_inputs).items()
             if "custom_reward_function" not in key or any(arg.startswith(f"{key}=") for arg in args)}  # a path the script gives
    local.update(fitted_sp(args))
    code = check_main([trainer, "--nproc-per-node", "2", "--device", "cpu", *with_local(args, local)])
    output = capsys.readouterr()
    problems = output.err.partition("the run would not start:\n")[2].strip().splitlines()
    assert "not a key of fsdptrain" not in output.err and "HydraException" not in output.err and "Could not override" not in output.err
    expected = V09_REFUSED.get(script.name, set())
    if not expected:
        assert code == 0 and f"the {trainer} run would start" in output.out, output.err[-3000:]
        if "multiturn" in script.parent.name:
            assert "data.multiturn.enable=true" in output.err
        return
    assert code == 1 and 1 <= len([p for p in problems if p.strip() and not p.endswith("problems:")]) <= 3, problems
    assert all(any(key in problem for key in expected) for problem in problems if not problem.endswith("problems:")), problems


def test_the_docs_table_lists_every_key():
    page = (REPO / "docs" / "from_verl.md").read_text()
    for trainer, entries in yaml.safe_load(open(TABLE)).items():
        for key in entries:
            assert f"`{key}" in page, f"{trainer}: {key} is not in docs/from_verl.md"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the example rolls out with vLLM, which is not installed")
def test_verls_example_trains_two_steps(tmp_path, vllm_llama, rl_data):
    """The example as written (vLLM rollouts, KL loss, the reference offloaded, gradient checkpointing, liger and
    fused-kernel keys) on 2 CPU processes, with the launcher, paths and sizes changed."""
    out = str(tmp_path / "run")
    result = torchrun(2, "fsdptrain.grpo_trainer", with_local(script_overrides(EXAMPLE), sizes_and_paths(vllm_llama, rl_data, out)))
    assert "use_liger=true: liger's Triton kernels need a CUDA device, this run is on cpu" in result.stdout
    # The script logs to the console and wandb (offline here), not to a file: the console lines are the metrics.
    lines = re.findall(r"^step (\d+) \| (?!plots:)(.*)$", result.stdout, re.MULTILINE)
    assert [int(step) for step, _ in lines] == [1, 2], result.stdout[-3000:]
    for _, line in lines:  # the KL loss against the offloaded reference, as the script asks
        assert "actor/kl_loss" in line and "timing_s/ref" in line and "training/rollout_probs_diff_max" in line
    assert "val-core/arithmetic/acc/mean@1" in lines[1][1]
    assert os.path.isdir(os.path.join(out, "wandb"))


GSM8K_SFT = ["run_qwen_05.sh", "run_qwen_05_peft.sh"]


def gsm8k_extra_info(path: Path, rows: int) -> str:
    """verl's GSM8K SFT layout: the question and answer in a dict column, extra_info."""
    pq.write_table(pa.table({"extra_info": [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                                             "index": i, "split": "train"} for i in range(rows)]}), path)
    return str(path)


@pytest.mark.parametrize("name", GSM8K_SFT)
def test_verls_sft_examples_load_with_every_key_known(tmp_path, name):
    local = {"data.train_files": tmp_path / "train.parquet", "data.val_files": tmp_path / "test.parquet", "model.partial_pretrain": "/models/x",
             "trainer.default_local_dir": tmp_path / "run", "data.micro_batch_size_per_gpu": 2}
    overrides, problems = translate(with_local(script_overrides(EXAMPLES / name), local), "sft", 2)
    assert problems == []
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_sft_config(compose(config_name="sft_trainer", overrides=overrides))
    assert (config.data.prompt_key, config.data.prompt_dict_keys, config.data.response_dict_keys) == ("extra_info", ["question"], ["answer"])
    assert config.model.lora_rank == (32 if "peft" in name else 0)


@pytest.mark.slow
def test_verls_lora_sft_example_trains_two_steps(tmp_path, tokenizer):
    """verl's GSM8K LoRA SFT example as written (questions and answers read from a dict column), on 2 CPU processes."""
    model = save_tiny_model(tmp_path / "model", "llama", tokenizer)
    local = {"data.train_files": gsm8k_extra_info(tmp_path / "train.parquet", 32), "data.val_files": gsm8k_extra_info(tmp_path / "test.parquet", 8),
             "model.partial_pretrain": model, "trainer.default_local_dir": tmp_path / "run", "data.micro_batch_size_per_gpu": 2,
             "data.train_batch_size": 8, "trainer.total_training_steps": 2, "data.max_length": 128, "trainer.device": "cpu"}
    result = torchrun(2, "fsdptrain.sft_trainer", with_local(script_overrides(EXAMPLES / "run_qwen_05_peft.sh"), local))
    lines = re.findall(r"^step (\d+) \| (?!plots:)(.*)$", result.stdout, re.MULTILINE)
    assert [int(step) for step, _ in lines] == [1, 2], result.stdout[-3000:]
    assert os.path.isfile(tmp_path / "run" / "global_step_2" / "meta.json")


MULTI_TURN = EXAMPLES / "run_qwen2.5-3b_gsm8k_multiturn.sh"
# The script's --config-path and --config-name, its folder here: the multi-turn keys come from that YAML
MULTI_TURN_CONFIG = [f"--config-path={EXAMPLES / 'sglang_multiturn_config'}", "--config-name=gsm8k_multiturn_grpo"]


def multi_turn_local(model: str, data: Path, out: str) -> dict[str, object]:
    return {**sizes_and_paths(model, data, out), "data.max_prompt_length": 64, "data.max_response_length": 64,
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.2, "trainer.total_training_steps": 1,
            "trainer.test_freq": 1, "actor_rollout_ref.rollout.multi_turn.tool_config_path": EXAMPLES / "gsm8k_tool_config.yaml"}


def test_verls_multi_turn_example_loads_with_its_tool(tmp_path, capsys):
    overrides, problems = translate([*MULTI_TURN_CONFIG, *with_local(script_overrides(MULTI_TURN), multi_turn_local("/models/x", tmp_path, str(tmp_path)))],
                                    "grpo", 2)
    assert problems == []
    notes = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.name=sglang_async is actor_rollout_ref.rollout.name=vllm here" in notes and "data.return_raw_chat" in notes
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=overrides))
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.name, rollout.tensor_model_parallel_size, rollout.multi_turn.enable, rollout.multi_turn.max_assistant_turns) == ("vllm", 2, True, 5)
    (tool,) = load_tools(rollout.multi_turn.tool_config_path).values()
    assert type(tool).__name__ == "Gsm8kTool" and tool.name == "calc_gsm8k_reward"


def test_the_ported_gsm8k_tool_behaves_as_verls():
    (tool,) = load_tools(str(EXAMPLES / "gsm8k_tool_config.yaml")).values()

    async def episode() -> list:
        instance = await tool.create(ground_truth="408")
        replies = [await tool.execute(instance, {"answer": answer}) for answer in ("12", "408", "408")]
        return [*replies, await tool.calc_reward(instance)]

    wrong, right, again, reward = asyncio.run(episode())
    assert [r[1] for r in (wrong, right, again)] == [-0.05, 0.0, -0.05]  # no gain costs 0.05
    assert right[0] == "Current parsed answer='408' reward=1.0" and reward == 1.0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the example rolls out with vLLM (for SGLang), which is not installed")
def test_verls_multi_turn_example_trains_a_step(tmp_path, tool_model):
    """The multi-turn example as written (its SGLang engine as vLLM's, split over both ranks, tensor_model_parallel_size=2;
    the KL loss; the tool YAML) on 2 CPU processes with a tiny model that calls a tool the YAML does not have: each
    call answered with the error, counted; validation through the same loop."""
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "val"):
        rows = [{"prompt": [{"role": "user", "content": f"What is {i + 3} * {2 * i + 5}?"}], "data_source": "openai/gsm8k",
                 "reward_model": {"ground_truth": "408", "style": "rule"},
                 "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "408"}}}}} for i in range(8)]
        pq.write_table(pa.Table.from_pylist(rows), data / f"rl_{split}.parquet")
    out = str(tmp_path / "run")
    result = torchrun(2, "fsdptrain.grpo_trainer", [*MULTI_TURN_CONFIG, *with_local(script_overrides(MULTI_TURN), multi_turn_local(tool_model, data, out))])
    assert "tensor_parallel_size=2" in result.stdout + result.stderr
    (line,) = re.findall(r"^step 1 \| (?!plots:)(.*)$", result.stdout, re.MULTILINE)
    metrics = dict(item.rsplit(" ", 1) for item in line.split(" | "))
    assert float(metrics["multi_turn/tool_calls_per_trajectory"]) > 0
    assert metrics["multi_turn/tool_errors_per_trajectory"] == metrics["multi_turn/tool_calls_per_trajectory"]
    assert "val-core/openai/gsm8k/acc/mean@1" in metrics


# The sizes of 2 CPU processes, one rollout engine each, in place of a verl example's own
EXAMPLE_SIZES = {"trainer.nnodes": 1, "actor_rollout_ref.rollout.tensor_model_parallel_size": 1, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 512,
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 512, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 512,
                 "trainer.logger": "[console]", "trainer.save_freq": -1}


# verl 0.9.0's FSDP examples of the architectures it names, each with the model type of its tiny stand-in
EXAMPLE_ARCHITECTURES = {"grpo_trainer/run_mistral_nemo_12b_skyworkrm_fsdp.sh": "mistral", "grpo_trainer/run_qwen3_30b_a3b_fsdp.sh": "qwen3_moe",
                         "grpo_trainer/run_seed_oss_36b_fsdp.sh": "seed_oss", "grpo_trainer/run_qwen3_next_80b_a3b_fsdp.sh": "qwen3_next"}


def v09_example(script: str, model: str, data: Path, out: str, **local) -> list[str]:
    """A verl 0.9.0 example's arguments, as bash computes them, with the launcher, paths and sizes changed for 2 CPU
    processes (one rollout engine each)."""
    positional = ("2", out) if script.startswith("sft/") else ()
    _, args = launch_arguments(V09_EXAMPLES / script, *positional)
    return with_local(args, {**sizes_and_paths(model, data, out), **EXAMPLE_SIZES, **fitted_sp(args), **local})


def console_steps(stdout: str) -> list[tuple[str, str]]:
    return re.findall(r"^step (\d+) \| (?!plots:)(.*)$", stdout, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the examples roll out with vLLM, which is not installed")
@pytest.mark.parametrize("script", ["ppo_trainer/run_qwen3_8b_fsdp.sh", *EXAMPLE_ARCHITECTURES],
                         ids=["ppo", *(EXAMPLE_ARCHITECTURES[script] for script in EXAMPLE_ARCHITECTURES)])
def test_verl_09s_examples_train_a_step(tmp_path, tokenizer, vllm_llama, rl_data, script):
    """verl 0.9.0's PPO example (a critic in verl 0.9's critic.fsdp section, padded) and its examples of the
    architectures verl names (a tiny model of each example's own: Qwen3-MoE offloaded, Seed-OSS with its dropout
    and vLLM's Transformers backend, Qwen3-Next with activation offload and bf16 (vLLM's CPU build runs its linear
    attention in bf16 only), Mistral-Nemo windowed with verl 0.9's reward.reward_model section) as bash
    computes them, vLLM rollouts, on 2 CPU processes with the launcher, paths, model and sizes changed: check passes,
    then a step each (GRPO with the KL loss and the reference offloaded is test_verls_example_trains_two_steps's, on
    the script it grew from)."""
    from test_reward_model import save_reward_model

    local, arch = {}, EXAMPLE_ARCHITECTURES.get(script)
    if arch is not None:  # vLLM's CPU attention needs heads 64 wide
        linear = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2) if arch == "qwen3_next" else {}
        vllm_llama = save_tiny_model(tmp_path / arch, arch, tokenizer, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=64, **linear)
    if arch == "qwen3_next":  # vLLM's CPU build runs its linear attention in bf16 only: the engine runs in the compute dtype
        local = {"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "bf16"}
    if script.startswith("ppo"):
        # a padded critic beside the packed actor, as verl's older PPO examples ran it
        local = {"critic.model.path": vllm_llama, "critic.ppo_max_token_len_per_gpu": 512, "critic.model.use_remove_padding": False}
    if "skyworkrm" in script:
        local = {"reward.reward_model.model_path": save_reward_model(tmp_path / "rm", tokenizer), "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2}
    out = str(tmp_path / "run")
    args = v09_example(script, vllm_llama, rl_data, out, **{**local, "trainer.total_training_steps": 1, "trainer.test_freq": 1})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0  # what a user runs first
    result = torchrun(2, "fsdptrain.grpo_trainer", args)
    lines = console_steps(result.stdout)
    assert [int(step) for step, _ in lines] == [1], result.stdout[-3000:]
    key = "critic/vf_loss" if script.startswith("ppo") else "critic/score/mean"
    assert all(key in line and "actor/pg_loss" in line and "training/rollout_probs_diff_max" in line for _, line in lines), lines
    if arch is not None:  # vLLM samples from the distribution the trainer computes (windows, sinks, dropout off)
        metrics = dict(item.rsplit(" ", 1) for item in lines[0][1].split(" | "))
        bound = 0.05 if arch == "qwen3_next" else 1e-3  # bf16 on both sides there
        assert float(metrics["training/rollout_probs_diff_max"]) < bound, metrics["training/rollout_probs_diff_max"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the recipes roll out with vLLM, which is not installed")
@pytest.mark.parametrize("script", ["run_qwen2_5_7b_fsdp.sh", "run_qwen2_5_7b_fsdp_multi_rs.sh"])
def test_verls_rollout_correction_recipes_train_a_step(tmp_path, vllm_llama, rl_data, script):
    """Rollout correction in bypass mode as verl main's recipes set it (tests/verl_examples/recipes/: sequence-level
    weights batch-normalized, one or three chained rejection criteria, the reinforce loss), vLLM rollouts, on 2 CPU
    processes with the launcher, paths, model and sizes changed: check passes, then a step, its rejected share logged."""
    _, args = launch_arguments(EXAMPLES / "recipes" / "rollout_correction" / script)
    out = str(tmp_path / "run")
    args = with_local(args, {**sizes_and_paths(vllm_llama, rl_data, out), **EXAMPLE_SIZES, "trainer.total_training_steps": 1, "trainer.test_freq": 1,
                             "custom_reward_function.path": rl_data / "reward.py"})  # scores that differ within a group
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
    result = torchrun(2, "fsdptrain.grpo_trainer", args)
    ((step, line),) = console_steps(result.stdout)
    metrics = dict(item.rsplit(" ", 1) for item in line.split(" | "))
    assert step == "1" and float(metrics["actor/grad_norm"]) > 0 and "actor/rollout_rs_masked_fraction" in metrics, metrics


GDPO_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    accuracy = solution_str.count("e") / max(len(solution_str), 1)
    form = float(len(solution_str) > 10)
    return {"score": accuracy + form, "accuracy_reward": accuracy, "format_reward": form}
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the recipes roll out with vLLM, which is not installed")
@pytest.mark.parametrize("script, env", [("on_policy_distillation/run_qwen3_8b_fsdp.sh", {}),
                                         ("on_policy_distillation/run_qwen3_8b_fsdp.sh", {"USE_POLICY_GRADIENT": "False", "DISTILLATION_LOSS_MODE": "k3"}),
                                         ("gdpo/run_qwen3_8b_fsdp.sh", {})],
                         ids=["distillation_k1_policy_gradient", "distillation_k3_supervised", "gdpo"])
def test_verls_distillation_and_gdpo_recipes_train_a_step(tmp_path, tokenizer, vllm_llama, rl_data, script, env):
    """On-policy distillation as verl main's recipe sets it (a teacher of the student's vocabulary, one response a
    prompt, no task rewards; k1 as the policy gradient's reward, and k3 as a supervised loss) and GDPO with its
    reward manager (a reward function's dict of rubric scores), vLLM rollouts, on 2 CPU processes with the launcher,
    paths, model and sizes changed: check passes, then a step, the distillation or the rubric's scores logged."""
    _, args = launch_arguments(EXAMPLES / "recipes" / script, env=env)
    out = str(tmp_path / "run")
    local = {**sizes_and_paths(vllm_llama, rl_data, out), **EXAMPLE_SIZES, "trainer.total_training_steps": 1, "trainer.test_freq": 1}
    if script.startswith("gdpo"):
        (tmp_path / "rubric.py").write_text(GDPO_REWARD)
        local["reward.custom_reward_function.path"] = tmp_path / "rubric.py"
    else:
        local["distillation.teacher_models.teacher_model.model_path"] = save_tiny_model(
            tmp_path / "teacher", "llama", tokenizer, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, initializer_range=0.2)
        local["distillation.teacher_models.teacher_model.log_prob_micro_batch_size_per_gpu"] = 2
    args = with_local(args, local)
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
    result = torchrun(2, "fsdptrain.grpo_trainer", args)
    ((step, line),) = console_steps(result.stdout)
    metrics = dict(item.rsplit(" ", 1) for item in line.split(" | "))
    assert step == "1" and float(metrics["actor/grad_norm"]) > 0, metrics
    if script.startswith("gdpo"):
        assert {"critic/rewards/accuracy_reward/mean", "critic/rewards/format_reward/mean"} <= metrics.keys(), metrics
    else:
        assert float(metrics["actor/distillation/loss"]) != 0 and ("actor/distillation/pg_clipfrac" in metrics) == (not env), metrics


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the example rolls out with vLLM, which is not installed")
def test_verl_09s_gpt_oss_example_is_refused_with_vllm_on_cpu_and_trains_on_the_hf_engine(tmp_path, tokenizer, rl_data, capsys):
    """vLLM's CPU build computes gpt-oss's log-probs differently from transformers (so from the trainer): check
    refuses the example as written on CPU, naming the key; with the hf engine, a step trains, its engine's sampling
    probabilities the trainer's."""
    model = save_tiny_model(tmp_path / "gpt_oss", "gpt_oss", tokenizer)
    out = str(tmp_path / "run")
    args = v09_example("grpo_trainer/run_gpt_oss_20b_fsdp.sh", model, rl_data, out, **{"trainer.total_training_steps": 1, "trainer.test_freq": 1})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 1
    said = capsys.readouterr().err
    assert "vLLM's CPU build computes gpt_oss's token log-probs differently" in said and "rollout.name=hf" in said, said
    result = torchrun(2, "fsdptrain.grpo_trainer", [*args, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.calculate_log_probs=true"])
    (line,) = [line for _, line in console_steps(result.stdout)]
    metrics = dict(item.rsplit(" ", 1) for item in line.split(" | "))
    assert float(metrics["training/rollout_probs_diff_max"]) < 1e-3, metrics


@pytest.mark.slow
def test_verl_09s_new_layout_sft_example_trains_two_steps(tmp_path, tiny_llama):
    """verl 0.9.0's GSM8K SFT example (verl.trainer.sft_trainer: model.path, engine=fsdp, data.messages_key) as bash
    computes it, on 2 CPU processes with the launcher, paths and sizes changed: multi-turn chat data, two steps."""
    import demo_data

    data = tmp_path / "chats.parquet"
    demo_data.write_chat_parquet(str(data), 16, seed=0)
    _, args = launch_arguments(V09_EXAMPLES / "sft/gsm8k/run_qwen2_5_0_5b_fsdp.sh", "2", str(tmp_path / "run"))
    local = {"data.train_files": data, "data.val_files": data, "model.path": tiny_llama, "data.micro_batch_size_per_gpu": 2,
             "data.train_batch_size": 8, "data.max_length": 256, "trainer.total_training_steps": 2, "trainer.logger": "[console]",
             "trainer.device": "cpu"}
    result = torchrun(2, "fsdptrain.sft_trainer", with_local(args, local))
    assert "data.multiturn.enable=true" in result.stderr
    assert [int(step) for step, _ in console_steps(result.stdout)] == [1, 2], result.stdout[-3000:]


def test_verls_deletions_remove_what_can_be_removed(capsys):
    """`~key`: a key of an open mapping is removed from it; a key that may be null becomes null; one that may not
    keeps fsdptrain's default; a refused feature's key has nothing to remove; an unknown one is named."""
    overrides, problems = translate(["+data.apply_chat_template_kwargs.effort=high", "~data.apply_chat_template_kwargs.effort",
                                     "~algorithm.rollout_correction.rollout_is", "~actor_rollout_ref.actor.optim.lr",
                                     "~actor_rollout_ref.actor.megatron.param_offload", "~actor_rollout_ref.actor.optim.lrr"], "grpo", 2)
    assert overrides == ["++data.apply_chat_template_kwargs.effort=high", "~data.apply_chat_template_kwargs.effort",
                         "algorithm.rollout_correction.rollout_is=null"]
    assert problems == ["~actor_rollout_ref.actor.optim.lrr: not a key of fsdptrain's grpo_trainer.yaml (did you mean actor_rollout_ref.actor.optim.lr?)"]
    notes = capsys.readouterr().err
    assert "~actor_rollout_ref.actor.optim.lr changes nothing here: actor_rollout_ref.actor.optim.lr takes no null" in notes
    assert "~actor_rollout_ref.actor.megatron.param_offload changes nothing here" in notes
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        config = load_grpo_config(compose(config_name="grpo_trainer", overrides=[*overrides, "data.train_files=a.parquet", "actor_rollout_ref.model.path=/m"]))
    assert config.data.apply_chat_template_kwargs == {} and config.algorithm.rollout_correction.rollout_is is None


def test_a_users_yaml_in_verls_layout(tmp_path):
    """--config-path/--config-name (either spelling, with `=` or not): the file's keys come before the command line's,
    which wins, as in Hydra; its `defaults` name verl's trainer config, or pick a config group; verl's own trainer
    configs, named relative to verl's config folder, are the defaults here, or refused by name (Megatron's)."""
    (tmp_path / "mine.yaml").write_text("hydra:\n  searchpath: [file://verl/trainer/config]\ndefaults:\n  - ppo_trainer\n  - _self_\n"
                                        "data:\n  max_prompt_length: 512\n  return_raw_chat: True\n  apply_chat_template_kwargs: {effort: 'a b'}\n"
                                        "actor_rollout_ref:\n  actor:\n    optim: {lr: 3e-6}\n  rollout:\n    name: sglang\n    n: 4\n")
    for flags in ([f"--config-path={tmp_path}", "--config-name=mine"], ["-cp", str(tmp_path), "-cn", "mine.yaml"]):
        overrides, problems = translate([*flags, "actor_rollout_ref.rollout.n=8"], "grpo", 2)
        assert problems == []
        assert overrides == ["data.max_prompt_length=512", "++data.apply_chat_template_kwargs.effort='a b'", "actor_rollout_ref.actor.optim.lr=3e-6",
                             "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.n=8"]
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            config = load_grpo_config(compose(config_name="grpo_trainer", overrides=[*overrides, "data.train_files=a.parquet", "actor_rollout_ref.model.path=/m"]))
        assert (config.data.max_prompt_length, config.actor_rollout_ref.actor.optim.lr, config.actor_rollout_ref.rollout.n) == (512, 3e-6, 8)
        assert config.data.apply_chat_template_kwargs == {"effort": "a b"}
    (tmp_path / "sft.yaml").write_text("defaults:\n  - sft_trainer\n  - model: hf_model\n  - _self_\ndata:\n  max_length: 256\n")
    overrides, problems = translate([f"--config-path={tmp_path}", "--config-name=sft"], "sft", 2)
    assert problems == [] and overrides == ["data.max_length=256"]
    assert translate(["--config-path=config", "--config-name=ppo_trainer"], "grpo", 2) == ([], [])
    with pytest.raises(ConfigError, match=r"2 problems:\n  --config-name=ppo_megatron_trainer.yaml: verl's Megatron trainer config"):
        translate(["--config-path=config", "--config-name=ppo_megatron_trainer.yaml", "actor_rollout_ref.actor.megatron.param_offload=True"], "grpo", 2)
    _, problems = translate([f"--config-path={tmp_path}", "--config-name=absent"], "grpo", 2)
    assert problems == [f"--config-name=absent: no file {tmp_path}/absent.yaml (--config-path={tmp_path})"]


def test_check_reads_a_users_yaml(tmp_path, tiny_llama, rl_data, capsys):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n    n: 3\n")
    args = with_local([], {**sizes_and_paths(tiny_llama, rl_data, str(tmp_path / "out")), "data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2})
    assert check_main(["grpo", "--nproc-per-node", "2", "--device", "cpu", "--config-path", str(tmp_path), "--config-name", "mine", *args]) == 0
    assert "2 prompts x 3 responses" in capsys.readouterr().out
