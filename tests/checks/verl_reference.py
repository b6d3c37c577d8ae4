"""verl 0.9's own `verl/trainer/ppo/core_algos.py`, imported from the `verl==0.9.1` wheel that `scripts/setup.sh test`
unpacks under .cache/verl-0.9.1 (not installed: the wheel also ships top-level `tests` and `scripts` packages), as
the reference the project's formulas are tested against. verl's package __init__ and its heavy imports (ray,
tensordict, ...) are left out: the package is entered below its __init__, and the modules that core_algos reaches
only for other workers are empty stand-ins."""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

STAND_INS = {"ray", "tensordict", "codetiming", "orjson"}


class StandIn(types.ModuleType):
    """A module whose every attribute is an inert class: enough for imports and annotations never executed."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


UNPACKED = Path(__file__).resolve().parents[2] / ".cache" / "verl-0.9.1" / "verl"


def load_verl(module: str) -> types.ModuleType | None:
    """One of verl's modules (`verl.trainer.ppo.core_algos`, `verl.utils.torch_functional`), or None where the
    wheel is not unpacked."""
    if not (UNPACKED / "trainer" / "ppo" / "core_algos.py").is_file():
        return None
    if "verl" not in sys.modules:
        sys.meta_path.append(StandInFinder())  # last: a real module, where installed, is found first
        package = types.ModuleType("verl")
        package.__path__ = [str(UNPACKED)]
        sys.modules["verl"] = package
        # entered below its __init__ too, which reads every dataset class (`datasets`, `pandas`); the losses only need
        # its dataset_utils
        dataset = types.ModuleType("verl.utils.dataset")
        dataset.__path__ = [str(UNPACKED / "utils" / "dataset")]
        sys.modules["verl.utils.dataset"] = dataset
    return importlib.import_module(module)


def load_core_algos() -> types.ModuleType | None:
    """verl's core_algos module, or None where the wheel is not unpacked."""
    return load_verl("verl.trainer.ppo.core_algos")
