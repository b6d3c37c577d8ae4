"""The package's shape, as docs/architecture.md states it: no import cycle between modules, the RL components
take explicit settings (no rl module reads the config), the config takes its allowed names from the dispatch
tables, and no function grows past ~60 lines without a reason written beside it."""

import ast

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
    """The project modules a module imports at its top level (imports inside functions are deferred on purpose)."""
    found = set()
    for node in tree.body:
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


def test_rl_components_do_not_read_the_config():
    trees = modules()
    for name, tree in trees.items():
        if name.startswith("fsdptrain.rl"):
            config_imports = {m for m in imports(tree, set(trees)) if m.startswith("fsdptrain.config.") and m != "fsdptrain.config.shared"}
            assert not config_imports, f"{name} imports {config_imports}: pass it explicit settings instead"


def test_allowed_names_come_from_the_dispatch_tables():
    from fsdptrain.config import grpo
    from fsdptrain.rl import core_algos, rewards, rollout, sampling

    assert grpo.POLICY_LOSSES == tuple(core_algos.POLICY_LOSS)
    assert grpo.LOSS_AGG_MODES == tuple(core_algos.LOSS_AGG)
    assert grpo.KL_ESTIMATORS == tuple(core_algos.KL_PENALTY)
    assert set(grpo.ADVANTAGE_ESTIMATORS) == set(core_algos.GROUP_ADVANTAGE) | set(core_algos.TOKEN_ADVANTAGE) | set(core_algos.CRITIC_ADVANTAGE)
    assert grpo.ENGINES is rollout.ENGINES and grpo.FILTER_KEYS is sampling.FILTER_KEYS and grpo.VERIFIERS is rewards.VERIFIERS


def test_long_functions_say_why():
    for path in sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "scripts").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > LONGEST:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                assert lines[first - 2].strip().startswith(REASON), (
                    f"{path.relative_to(REPO)}:{node.lineno} {node.name} is {node.end_lineno - node.lineno + 1} lines: split it, or say why "
                    f"on the line above ({REASON} ...)")
