"""Checkpoints: exact resume (same and other process counts), SIGKILL mid-save, rotation, HF export round trip, and
bad input, all through the real CLI under torchrun (its restarts after a lost worker: test_ownership.py)."""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from conftest import (
    REPO,
    assert_same_run,
    latest_checkpoint,
    losses,
    read_metrics,
    run_sft,
    sft_args,
    torchrun_cmd,
    wait_for,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow

STEPS = 6
SAVE_HF = "[model,optimizer,extra,hf_model]"
RUN = dict(trainer__total_training_steps=STEPS, optim__lr_warmup_steps_ratio=0.2, trainer__checkpoint__save_contents=SAVE_HF)


def start_sft(nproc: int, model, data, out, **overrides) -> subprocess.Popen:
    cmd = torchrun_cmd(nproc, "fsdptrain.sft_trainer", sft_args(model, data, out, **overrides))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_llama, chat_data):
    """Six steps on two processes without interruption (its output kept in output.txt)."""
    out = str(tmp_path_factory.mktemp("straight"))
    result = run_sft(2, tiny_llama, chat_data, out, **RUN)
    with open(os.path.join(out, "output.txt"), "w") as f:
        f.write(result.stdout + result.stderr)
    return out


def test_a_run_draws_its_plots_and_writes_plain_step_lines(straight, tmp_path):
    """Rank 0 draws the loss, lr, grad-norm and throughput plots; the plots command draws them again from the
    metrics file; with the output captured (not a terminal) the progress is a plain line a step, no bar."""
    from matplotlib.image import imread

    for name in ("loss", "lr", "grad_norm", "tokens_per_sec"):
        image = imread(os.path.join(straight, "plots", f"{name}.png"))
        assert image.shape[0] > 100 and image.std() > 0, name
    redrawn = subprocess.run([sys.executable, "-m", "fsdptrain.logging.plots", os.path.join(straight, "metrics.jsonl"), str(tmp_path)],
                             cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    assert [os.path.basename(p) for p in redrawn] == ["loss.png", "lr.png", "grad_norm.png", "tokens_per_sec.png"]
    with open(os.path.join(straight, "output.txt")) as f:
        output = f.read()
    assert "\r" not in output and "it/s]" not in output
    assert [int(n) for n in re.findall(r"^train: step (\d+)/6 ", output, re.M)] == list(range(1, STEPS + 1))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, tiny_llama, chat_data):
    """The same run, killed (SIGKILL, every rank) once its step-3 checkpoint is complete."""
    out = str(tmp_path_factory.mktemp("interrupted"))
    process = start_sft(2, tiny_llama, chat_data, out, trainer__save_freq=3, **RUN)
    wait_for_checkpoint(out, 3, process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert latest_checkpoint(out) == 3 and not os.path.exists(os.path.join(out, "global_step_6"))
    return out


@pytest.mark.parametrize("nproc, sp, fsdp_size", [(2, 1, -1), (1, 1, -1), (4, 1, -1), (2, 2, -1), (4, 1, 2)],
                         ids=["same", "dp1", "dp4", "sp2", "hsdp-2x2"])
def test_resume_reproduces_the_straight_run(tmp_path, tiny_llama, chat_data, straight, interrupted, nproc, sp, fsdp_size):
    """Saved with 2 processes (dp=2, sp=1); resumed with as many, fewer, more, with sequence parallelism, or
    hybrid-sharded (4 processes as 2 replicas of 2 shards)."""
    out = str(tmp_path / "run")
    shutil.copytree(interrupted, out)
    run_sft(nproc, tiny_llama, chat_data, out, ulysses_sequence_parallel_size=sp, model__fsdp_config__fsdp_size=fsdp_size, **RUN)
    tolerance = 1e-6 if (nproc, sp) == (2, 1) else 1e-5  # another layout sums in another order
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # steps the killed run logged past 3 are replaced
    assert [m["train/lr"] for m in metrics] == pytest.approx([m["train/lr"] for m in read_metrics(straight)], abs=1e-12)
    assert_same_run(out, straight, atol=tolerance)


def test_a_hybrid_sharded_checkpoint_resumes_sharded_over_every_rank(tmp_path, tiny_llama, chat_data, straight):
    """Saved hybrid-sharded (4 processes as 2 replicas of 2 shards), resumed as 2 processes sharding over both:
    the straight run's numbers."""
    out = str(tmp_path / "run")
    process = start_sft(4, tiny_llama, chat_data, out, trainer__save_freq=3, model__fsdp_config__fsdp_size=2, **RUN)
    wait_for_checkpoint(out, 3, process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    run_sft(2, tiny_llama, chat_data, out, **RUN)
    assert [m["step"] for m in read_metrics(out)] == list(range(1, STEPS + 1))
    assert_same_run(out, straight, atol=1e-5)


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, tiny_llama, chat_data, straight):
    out = str(tmp_path)
    process = start_sft(2, tiny_llama, chat_data, out, trainer__save_freq=2, trainer__max_ckpt_to_keep=1, **RUN)
    wait_for(os.path.join(out, ".global_step_4.tmp"), process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert latest_checkpoint(out) == 2
    assert os.path.isfile(os.path.join(out, "global_step_2", "meta.json"))  # the one to resume from is kept
    assert not os.path.exists(os.path.join(out, "global_step_4"))
    run_sft(2, tiny_llama, chat_data, out, trainer__save_freq=2, trainer__max_ckpt_to_keep=1, **RUN)
    assert losses(out) == pytest.approx(losses(straight), abs=1e-6)
    assert sorted(os.listdir(out)) == ["global_step_6", "latest_checkpointed_iteration.txt", "metrics.jsonl", "plots"]


def test_rotation_counts_what_is_on_disk_across_restarts(tmp_path, tiny_llama, chat_data):
    out = str(tmp_path)
    keep = dict(trainer__save_freq=1, trainer__max_ckpt_to_keep=2, optim__lr_scheduler="constant")
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=3, **keep)
    assert sorted(d for d in os.listdir(out) if d.startswith("global_step")) == ["global_step_2", "global_step_3"]
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=5, **keep)
    assert sorted(d for d in os.listdir(out) if d.startswith("global_step")) == ["global_step_4", "global_step_5"]
    assert latest_checkpoint(out) == 5


def test_export_round_trip(tmp_path, straight):
    step_dir = os.path.join(straight, f"global_step_{STEPS}")
    out = str(tmp_path / "hf")
    subprocess.run([sys.executable, "-m", "fsdptrain.checkpoint.export", step_dir, "--out", out], check=True, cwd=REPO)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    in_run = AutoModelForCausalLM.from_pretrained(os.path.join(step_dir, "huggingface"), dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(step_dir, "huggingface"), dtype=torch.float32)
    state = trained.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(step_dir, "model"))  # the trained shards themselves
    trained.load_state_dict(state)
    ids = torch.randint(0, trained.config.vocab_size, (2, 17))
    with torch.no_grad():
        reference = trained(ids).logits
        torch.testing.assert_close(exported(ids).logits, reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(in_run(ids).logits, reference, atol=1e-5, rtol=0)
    bf16 = str(tmp_path / "bf16")
    subprocess.run([sys.executable, "-m", "fsdptrain.checkpoint.export", step_dir, "--out", bf16, "--dtype", "bf16"], check=True, cwd=REPO)
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


def test_write_failure_is_clear_and_keeps_the_previous_checkpoint(tmp_path, tiny_llama, chat_data):
    """A file-size limit makes checkpoint writes fail (EFBIG), as a full disk would."""
    out = str(tmp_path)
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=2)
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731
    result = subprocess.run([sys.executable, "-m", "fsdptrain.sft_trainer", *sft_args(tiny_llama, chat_data, out, trainer__total_training_steps=4)],
                            cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert result.returncode != 0
    assert f"checkpoint save under {out} failed (is the disk full or not writable?)" in result.stderr
    assert latest_checkpoint(out) == 2 and os.path.isfile(os.path.join(out, "global_step_2", "meta.json"))
    assert not os.path.exists(os.path.join(out, "global_step_4"))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory, tiny_llama, chat_data):
    out = str(tmp_path_factory.mktemp("small"))
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=1, trainer__checkpoint__save_contents="[model,extra]")
    return out


def test_sft_resume_mode_auto_resumes_from_a_given_path(tmp_path, tiny_llama, chat_data, small_checkpoint):
    """verl's SFT trainers: resume_mode=auto (the default) with resume_from_path resumes from that checkpoint, not
    from the run folder's latest (verl's PPO trainer reads the path only with resume_mode=resume_path)."""
    out = str(tmp_path)
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=2, trainer__resume_mode="auto",
            trainer__resume_from_path=os.path.join(small_checkpoint, "global_step_1"), trainer__checkpoint__load_contents="[model,extra]")
    assert [m["step"] for m in read_metrics(out)] == [2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"trainer__resume_mode": "resume_path", "trainer__resume_from_path": "/no/such/dir"},
            "trainer.resume_from_path='/no/such/dir' does not exist",
        ),
        ({"trainer__resume_mode": "resume_path", "trainer__resume_from_path": "{ckpt}"}, "is not a checkpoint folder"),
        ({"trainer__resume_mode": "resume_path", "trainer__resume_from_path": "{ckpt}/global_step_1",
          "trainer__checkpoint__load_contents": "[model,optimizer]"}, r"load_contents asks for \['optimizer'\]"),
        ({"trainer__resume_mode": "resume_path", "trainer__resume_from_path": "{ckpt}/global_step_1",
          "model__partial_pretrain": "{qwen}"}, "another model architecture"),
    ],
    ids=["missing", "not-a-checkpoint", "contents", "architecture"],
)
def test_bad_resume_input_fails_before_training(tmp_path, tiny_llama, tiny_qwen2, chat_data, small_checkpoint, overrides, message):
    fill = {"ckpt": small_checkpoint, "qwen": tiny_qwen2}
    overrides = {k: v.format(**fill) for k, v in overrides.items()}
    out = str(tmp_path)
    result = run_sft(1, tiny_llama, chat_data, out, check=False, **overrides)
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))


def test_the_best_model_is_the_least_validation_loss_and_early_stopping_stays_stopped(tmp_path, tiny_llama, chat_data):
    """trainer.best_model: best/huggingface is the export of the step of least val/loss (its weights those of that
    step's checkpoint), val/best_loss the running least; with a threshold no later validation clears, training
    stops after `patience` validations, saves where it stopped, and a relaunch resumes into the stop, training none."""
    from safetensors.torch import load_file

    out = str(tmp_path / "best")
    run_sft(2, tiny_llama, chat_data, out, trainer__total_training_steps=4, trainer__test_freq=1, trainer__save_freq=1, optim__lr=2e-2,
            trainer__checkpoint__save_contents=SAVE_HF, trainer__best_model__save="true")
    metrics = read_metrics(out)
    val = [m["val/loss"] for m in metrics]
    best_step = 1 + val.index(min(val))
    assert [m["val/best_loss"] for m in metrics] == [min(val[: k + 1]) for k in range(4)]
    with open(os.path.join(out, "best", "meta.json")) as f:
        assert json.load(f) == {"global_step": best_step, "val/loss": min(val)}
    assert sorted(n for n in os.listdir(out) if n.startswith(("best", ".best"))) == ["best", f"best_step_{best_step}"]
    best = load_file(os.path.join(out, "best", "huggingface", "model.safetensors"))
    saved = load_file(os.path.join(out, f"global_step_{best_step}", "huggingface", "model.safetensors"))
    assert best.keys() == saved.keys() and all(torch.equal(best[k], saved[k]) for k in best)

    out = str(tmp_path / "stopped")
    stopping = dict(trainer__total_training_steps=6, trainer__test_freq=1, trainer__best_model__early_stopping_patience=2,
                    trainer__best_model__early_stopping_threshold=100)
    result = run_sft(1, tiny_llama, chat_data, out, **stopping)
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert "early stop at step 3" in result.stderr + result.stdout
    assert latest_checkpoint(out) == 3
    run_sft(1, tiny_llama, chat_data, out, **stopping)
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
