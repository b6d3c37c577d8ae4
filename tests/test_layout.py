"""The package's shape, as docs/architecture.md states it: no import cycle between modules nor between packages,
the config at the bottom (it imports nothing of fsdptrain's above it, and no torch), the RL components take
explicit settings (no rl module reads a trainer's config), no function below the plans takes the whole config, names are checked against registries that their
modules fill, and no function grows past ~60 lines without a reason written beside it."""

import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO

PACKAGE = REPO / "fsdptrain"
LONGEST = 60
REASON = "# long:"  # on the line above a longer function: why it is one function


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The project modules a module imports at its top level, those for type checking included (imports inside
    functions are deferred on purpose)."""
    found = set()
    type_checking = [node.body for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")]
    for node in [*tree.body, *(n for body in type_checking for n in body)]:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdptrain"):
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("fsdptrain"))
    return found & known


def test_no_module_imports_itself_back():
    trees = modules()
    graph = {name: imports(tree, set(trees)) for name, tree in trees.items()}
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in graph[name]:
            assert state.get(target) != "open", "import cycle: " + " -> ".join([*path[path.index(target):], target])
            if target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])


def package(module: str) -> str:
    """A module's package under fsdptrain (`fsdptrain.rl`), or the top-level module itself (`fsdptrain.errors`)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_package_imports_itself_back():
    trees = modules()
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        graph.setdefault(package(name), set()).update(package(m) for m in imports(tree, set(trees)) if package(m) != package(name))
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            assert state.get(target) != "open", "package cycle: " + " -> ".join([*path[path.index(target):], target])
            if target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_config_imports_nothing_above_it():
    trees = modules()
    for name, tree in trees.items():
        if name.startswith("fsdptrain.config"):
            above = {m for m in imports(tree, set(trees)) if not m.startswith("fsdptrain.config") and m != "fsdptrain.errors"}
            assert not above, f"{name} imports {above}: the config is the ground floor (the plan resolves names and sizes)"


def test_importing_the_config_loads_no_torch():
    code = "import sys, fsdptrain.config.grpo, fsdptrain.config.sft, fsdptrain.config.verl_keys; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', 'peft', 'vllm'))))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", loaded


def test_rl_components_do_not_read_the_config():
    trees = modules()
    for name, tree in trees.items():
        if name.startswith("fsdptrain.rl"):
            config_imports = {m for m in imports(tree, set(trees)) if m.startswith("fsdptrain.config.") and m != "fsdptrain.config.base"}
            assert not config_imports, f"{name} imports {config_imports}: pass it explicit settings instead"


# Where the whole config may be read: the config package, each trainer's plan (the one resolver of a run), and the
# entry points that hand the plan on (the trainers' main, check)
RESOLVERS = ("fsdptrain.config", "fsdptrain.trainer.grpo_plan", "fsdptrain.trainer.sft_plan", "fsdptrain.grpo_trainer",
             "fsdptrain.sft_trainer", "fsdptrain.check")


def test_no_function_below_the_plan_takes_the_whole_config():
    """Below the entry points and the plans, every function takes the plan or a section of it, never GRPOConfig or
    SFTConfig: a run is resolved in one place."""
    for name, tree in modules().items():
        if name.startswith(RESOLVERS):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    assert not re.search(r"\b(GRPOConfig|SFTConfig)\b", annotation), (
                        f"{name}.{node.name} takes {arg.arg}: {annotation}; give it the plan's fields (trainer/*_plan.py)")
            elif isinstance(node, ast.ImportFrom) and node.module in ("fsdptrain.config.grpo", "fsdptrain.config.sft"):
                names = {alias.name for alias in node.names}
                assert not names & {"GRPOConfig", "SFTConfig"}, f"{name} imports the whole config ({names}): it should take the plan"


def test_long_functions_say_why():
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "scripts").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > LONGEST:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert lines[first - 2].strip().startswith(REASON), (
                    f"{path.relative_to(REPO)}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines: split it, or say why "
                    f"on the line above ({REASON} ...)")


def test_a_registered_name_is_accepted_without_touching_the_config(tmp_path):
    """A new estimator, loss, engine or tool-call format is its function and its registration: the plan accepts
    its name with no other change, and refuses an unregistered one naming the key."""
    import torch
    from hydra import compose, initialize_config_module

    from fsdptrain.distributed.mesh import World
    from fsdptrain.errors import ConfigError
    from fsdptrain.rl.agent.tool_calls import TOOL_CALL_FORMATS
    from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, EstimatorInfo, grpo_advantages, vanilla_policy_loss
    from fsdptrain.rl.rollout import ROLLOUT_ENGINES
    from fsdptrain.trainer.grpo_plan import read_grpo_config

    keys = {"algorithm.adv_estimator": ADVANTAGE_ESTIMATORS, "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSSES,
            "actor_rollout_ref.rollout.name": ROLLOUT_ENGINES, "actor_rollout_ref.rollout.multi_turn.format": TOOL_CALL_FORMATS}
    entries = {"algorithm.adv_estimator": grpo_advantages, "actor_rollout_ref.actor.policy_loss.loss_mode": vanilla_policy_loss}
    infos = {"algorithm.adv_estimator": EstimatorInfo(min_group_size=2)}  # its declaration; a loss's and the others' are their registry's default
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")

    def read(key: str, value: str):
        overrides = ["data.train_files=x.parquet", "actor_rollout_ref.model.path=m", f"{key}={value}",
                     "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"]
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            return read_grpo_config(compose(config_name="grpo_trainer", overrides=overrides), world=World(0, 1, 1, torch.device("cpu")))

    for key, registry in keys.items():
        with pytest.raises(ConfigError, match=f"{key} must be one of .*got 'throwaway'"):
            read(key, "throwaway")
        registry.register("throwaway", info=infos.get(key))(entries.get(key, lambda *args: None))
        try:
            assert read(key, "throwaway")
        finally:
            del registry.entries["throwaway"], registry.info["throwaway"]


@pytest.mark.slow
def test_an_estimator_of_a_new_kind_is_its_function_and_declaration(tmp_path, tiny_llama, rl_data):
    """An estimator that reads what none of core_algos' combines (the critic's values, compared within a group:
    tests/checks/new_estimator_check.py), registered and declared: the plan builds its critic and refuses one
    response a prompt, and a GRPO run on 2 processes trains with it, the critic included."""
    import torch
    from hydra import compose, initialize_config_module

    from fsdptrain.distributed.mesh import World
    from fsdptrain.errors import ConfigError
    from fsdptrain.rl.core_algos import ADVANTAGE_ESTIMATORS
    from fsdptrain.trainer.grpo_plan import read_grpo_config, resolve_grpo

    from checks.new_estimator_check import group_value_baseline
    from conftest import read_metrics, torchrun
    from test_grpo import grpo_args

    assert ADVANTAGE_ESTIMATORS["group_value_baseline"] is group_value_baseline
    out = str(tmp_path / "run")
    args = grpo_args(tiny_llama, rl_data, out, algorithm__adv_estimator="group_value_baseline", trainer__total_training_steps=1,
                     critic__ppo_micro_batch_size_per_gpu=2, data__val_files="null")
    world = World(0, 2, 2, torch.device("cpu"))
    try:
        with initialize_config_module(config_module="fsdptrain.config", version_base=None):
            plan, _ = resolve_grpo(read_grpo_config(compose(config_name="grpo_trainer", overrides=args), world=world), world)
            assert plan.critic_model is not None
            with pytest.raises(ConfigError, match=r"group_value_baseline compares responses of one prompt: .*n must be >= 2, got 1"):
                read_grpo_config(compose(config_name="grpo_trainer", overrides=[*args, "actor_rollout_ref.rollout.n=1"]), world=world)
    finally:  # registered for this test alone: other tests walk the registry
        del ADVANTAGE_ESTIMATORS.entries["group_value_baseline"], ADVANTAGE_ESTIMATORS.info["group_value_baseline"]
        del sys.modules["checks.new_estimator_check"]
    result = torchrun(2, "tests.checks.new_estimator_check", args)
    assert result.stdout.count("group_value_baseline: 8 responses, 2 groups, values (8, ") == 2, result.stdout[-3000:]
    [metrics] = read_metrics(out)
    assert metrics["critic/vf_loss"] > 0 and metrics["actor/grad_norm"] > 0 and metrics["critic/advantages/max"] > metrics["critic/advantages/min"]


def test_tests_read_nothing_outside_the_repository():
    """A clone anywhere (a user's, a fork's CI) passes: no test or script it runs climbs above the repository,
    whether by `Path(__file__).parents[k]` past the root or by a relative path that leaves it."""
    climbing = []
    for path in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "scripts").glob("*.py")]):
        levels_to_root = len(path.relative_to(REPO).parts) - 1  # parents[levels_to_root] is the repository
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            outside = (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                       and isinstance(node.slice, ast.Constant) and node.slice.value > levels_to_root)
            outside |= isinstance(node, ast.Constant) and isinstance(node.value, str) and re.match(r"\.\.[/\\]", node.value) is not None
            if outside:
                climbing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not climbing, f"paths outside the repository: {climbing}"
