"""A user's mistake on 2 processes: a configuration with three mistakes, a value of the wrong type, a missing data
file and a reward function that returns NaN each end the run non-zero with the problem printed once by the
workers, without a Python traceback of theirs. Under the real torchrun launcher, torchrun's summary (its own
traceback included, which no worker controls) points to that line rather than printing the problem again;
launched as verl launches (`python -m fsdptrain.grpo_trainer trainer.n_gpus_per_node=2`), the whole output is at
most 15 lines."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, torchrun_cmd
from test_grpo import grpo_args

pytestmark = pytest.mark.slow

NAN_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"


def launch(module: str, args: list[str], launcher: str) -> tuple[int, list[str]]:
    cmd = torchrun_cmd(2, module, args) if launcher == "torchrun" else [sys.executable, "-m", module, *args, "trainer.n_gpus_per_node=2"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def worker_lines(lines: list[str]) -> list[str]:
    """The lines the workers printed: all but torchrun's own (its log lines, its traceback and its summary)."""
    start = next((i for i, line in enumerate(lines) if "torch/distributed/elastic" in line and "failed (exitcode" in line), len(lines))
    return lines[:start]


# Under torchrun every kind of mistake; under the trainer's own workers one found in the config and one found
# while training (where the mistake is found is what differs between the kinds, not how a launcher prints it).
@pytest.mark.parametrize("case, launcher", [*((case, "torchrun") for case in ("three mistakes", "wrong type", "missing file", "nan reward")),
                                            ("three mistakes", "own workers"), ("nan reward", "own workers")])
def test_a_users_mistake_is_printed_once_without_a_traceback(tmp_path, tiny_llama, rl_data, case, launcher):
    (tmp_path / "nan.py").write_text(NAN_REWARD)
    module, args, problems = "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, str(tmp_path / "run")), []
    if case == "three mistakes":
        args += ["data.truncation=middle", "actor_rollout_ref.actor.clip_ratio_c=0.5", "algorithm.adv_estimator=remix"]
        problems = ["data.truncation must be one of", "clip_ratio_c must be > 1", "algorithm.adv_estimator must be one of"]
    elif case == "wrong type":
        args += ["data.max_prompt_length=long"]
        problems = ["data.max_prompt_length"]
    elif case == "missing file":
        args = [a.replace("rl_train.parquet", "no_such.parquet") for a in args]
        problems = ["no_such.parquet"]
    else:
        args += [f"custom_reward_function.path={tmp_path / 'nan.py'}"]
        problems = ["a finite score is required"]
    code, lines = launch(module, args, launcher)
    assert code != 0
    mine = worker_lines(lines) if launcher == "torchrun" else lines
    text = "\n".join(mine)
    assert "Traceback" not in text, text
    for problem in problems:
        assert text.count(problem) == 1, (problem, text)
    if launcher == "torchrun":
        summary = "\n".join(lines[len(mine):])
        assert problems[0] not in summary and "traceback : the problem is printed above" in summary, summary
    else:
        assert len(lines) <= 15, text
        assert re.fullmatch(r"fsdptrain: fsdptrain.grpo_trainer stopped: rank [01] exited with code 1", lines[-1]), text
