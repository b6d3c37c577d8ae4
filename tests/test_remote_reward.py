"""The remote reward path on the loopback address only, every server bounded in requests and time: the client
(rl/remote_reward.py) against a server that answers, answers slowly, stalls, fails with 500s, sends bad JSON, the
wrong number of rewards or NaN, and recovers; fsdptrain's reward server (reward_server.py) answering the function's
own scores, also to concurrent requests; and GRPO runs whose server dies mid-run: the step fails naming the URL,
and the resumed run equals one whose server never died."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fsdptrain.rl.data import Prompt
from fsdptrain.rl.remote_reward import RemoteReward, RemoteRewardError
from fsdptrain.rl.rewards import load_reward_function
from fsdptrain.rl.rollout.base import Generation, group_ids

from conftest import REPO, free_port, read_metrics, torchrun, wait_until_serving
from test_grpo import grpo_args

STALL_S, TIMEOUT_S = 3.0, 0.5


def fault_app(requests: dict[str, int]) -> Starlette:
    """One route per behaviour; `requests` counts each route's requests."""

    async def answer(request):
        mode = request.path_params["mode"]
        requests[mode] = requests.get(mode, 0) + 1
        texts = (await request.json())["query"]
        good = {"rewards": [float(len(t)) for t in texts]}
        if mode == "slow":
            await asyncio.sleep(TIMEOUT_S / 3)
        elif mode == "stall":
            await asyncio.sleep(STALL_S)
        elif mode == "error" or (mode == "recovers" and requests[mode] <= 2):
            return JSONResponse({"error": "boom"}, status_code=500)
        elif mode == "badjson":
            return Response("{rewards: [1,", media_type="application/json")
        elif mode == "short":
            good["rewards"] = good["rewards"][:-1]
        elif mode == "nan":
            good["rewards"][0] = float("nan")
        return Response(json.dumps(good), media_type="application/json")  # json.dumps writes NaN; JSONResponse refuses it

    return Starlette(routes=[Route("/{mode}", answer, methods=["POST"])])


@pytest.fixture(scope="module")
def fault_server():
    """The fault server in a thread of this process for the module's tests, then stopped (bounded by the tests)."""
    requests, port = {}, free_port()
    server = uvicorn.Server(uvicorn.Config(fault_app(requests), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}", requests
    server.should_exit = True
    thread.join(timeout=STALL_S + 5)


def rollout(count: int) -> tuple[list[Generation], list[Prompt]]:
    prompts = [Prompt(ids=[1, 2, 3], messages=[{"role": "user", "content": f"q{i}"}], ground_truth=str(i), data_source="arithmetic", extra_info={})
               for i in range(count // 2)]
    generations = [Generation([1, 2, 3], [40 + i] * (i + 1), [1] * (i + 1), None, False) for i in range(count)]
    return generations, prompts


def client(url: str, tokenizer, retries: int = 2) -> RemoteReward:
    return RemoteReward(url, tokenizer, batch_size=3, max_concurrency=2, timeout_s=TIMEOUT_S, retries=retries, backoff_s=0.01)


@pytest.mark.parametrize("mode, failure", [
    ("stall", "ReadTimeout"), ("error", "status 500"), ("badjson", "a reply that is not"), ("short", "2 rewards for 3 texts"),
    ("nan", "not finite"),
])
def test_each_failure_is_retried_then_named(fault_server, tokenizer, mode, failure):
    url, requests = fault_server
    generations, prompts = rollout(6)
    start, before = time.monotonic(), requests.get(mode, 0)
    with pytest.raises(RemoteRewardError) as error:
        client(f"{url}/{mode}", tokenizer)(generations, prompts, group_ids(len(prompts), 2))
    assert f"reward_model.remote_rm_url={url}/{mode}: batch" in str(error.value) and "failed 3 times" in str(error.value)
    assert failure in str(error.value)
    assert requests[mode] - before <= 2 * 3  # two batches, three tries at most each
    assert time.monotonic() - start < 2 * 3 * TIMEOUT_S + 5  # never waits on a stalled server past the timeouts


@pytest.mark.parametrize("mode", ["ok", "slow", "recovers"])
def test_answers_slow_answers_and_recoveries_give_the_servers_rewards(fault_server, tokenizer, mode):
    url, _ = fault_server
    generations, prompts = rollout(6)
    rewards = client(f"{url}/{mode}", tokenizer, retries=3)(generations, prompts, group_ids(len(prompts), 2))
    expected = [float(len(tokenizer.decode(prompts[i // 2].ids) + tokenizer.decode(g.response_ids, skip_special_tokens=True)))
                for i, g in enumerate(generations)]
    assert rewards == expected


@pytest.fixture
def reward_server(rl_data):
    """fsdptrain's reward server for rl_data's reward function, in its own process, stopped after the test."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.checks.reward_server_check", str(rl_data / "reward.py"), str(port)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/get_reward"
    wait_until_serving(url, process)
    yield url
    process.kill()
    process.wait(timeout=10)


def test_the_reward_server_answers_its_functions_scores_to_concurrent_clients(reward_server, rl_data):
    fn = load_reward_function(str(rl_data / "reward.py"), None)
    payloads = [{"query": [f"P{i}: " + "e" * i + "x" * (9 - i), f"P{i}: abc"], "prompts": [f"P{i}: ", f"P{i}: "], "labels": ["1", "2"]}
                for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: httpx.post(reward_server, json=p, timeout=10.0).json(), payloads))
    for payload, reply in zip(payloads, replies):
        expected = [fn("remote", q[len(p):], label)["score"] for q, p, label in zip(payload["query"], payload["prompts"], payload["labels"])]
        assert reply["rewards"] == pytest.approx(expected, abs=1e-12) and reply["scores"] == reply["rewards"]
    bad = httpx.post(reward_server, json={"query": ["a"], "labels": ["1", "2"]}, timeout=10.0)
    assert bad.status_code == 400 and "differ in length" in bad.json()["error"]


@pytest.mark.slow
def test_validation_is_scored_by_the_server_as_training_is(tmp_path, tiny_llama, rl_data):
    """A run scored by a remote server alone (no reward function) validates with the server's scores: a server that
    gives 0.5 to every text gives a validation reward of 0.5 (it was 0 when validation used the reward function)."""
    (tmp_path / "half.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tests.checks.reward_server_check", str(tmp_path / "half.py"), str(port)], cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        wait_until_serving(url, server)
        out = str(tmp_path / "run")
        torchrun(2, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, reward_model__remote_rm_url=url, custom_reward_function__path="null",
                                                        trainer__total_training_steps=1, trainer__test_freq=1))
    finally:
        server.kill()
        server.wait(timeout=10)
    (metrics,) = read_metrics(out)
    assert metrics["critic/score/mean"] == 0.5
    assert metrics["val-core/arithmetic/reward/mean@1"] == 0.5 and metrics["val-core/arithmetic/acc/mean@1"] == 1.0


@pytest.mark.slow
def test_a_run_fails_when_its_server_dies_and_its_resume_equals_an_undisturbed_run(tmp_path, tiny_llama, rl_data, reward_server):
    remote = dict(custom_reward_function__path="null", reward_model__remote__retries=1, reward_model__remote__backoff_s=0.05,
                  reward_model__remote__timeout_s=10, reward_model__remote__batch_size=4, trainer__total_training_steps=3, trainer__save_freq=1,
                  trainer__test_freq=-1, trainer__rollout_data_dir="ROLLOUTS")

    def args(out: str, url: str) -> list[str]:
        return [a.replace("ROLLOUTS", f"{out}/rollouts") for a in grpo_args(tiny_llama, rl_data, out, reward_model__remote_rm_url=url, **remote)]

    undisturbed = str(tmp_path / "undisturbed")
    torchrun(2, "fsdptrain.grpo_trainer", args(undisturbed, reward_server))
    fn = load_reward_function(str(rl_data / "reward.py"), None)
    rows = [json.loads(line) for line in open(f"{undisturbed}/rollouts/1.jsonl")]
    assert [r["source/remote"] for r in rows] == pytest.approx([fn("arithmetic", r["response"], r["ground_truth"])["score"] for r in rows])
    assert [r["score"] for r in rows] == [r["source/remote"] for r in rows]  # the server alone scores

    # A server that dies after 5 requests: each rank sends 2 requests a step, so it dies during step 2.
    port = free_port()
    dying = subprocess.Popen([sys.executable, "-m", "tests.checks.reward_server_check", str(rl_data / "reward.py"), str(port), "--die-after", "5"],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        wait_until_serving(url, dying)  # one request
        failed = str(tmp_path / "failed")
        result = torchrun(2, "fsdptrain.grpo_trainer", args(failed, url), check=False)
    finally:
        dying.kill()
        dying.wait(timeout=10)
    assert result.returncode != 0
    assert f"reward_model.remote_rm_url={url}: batch" in result.stderr and "failed 2 times" in result.stderr
    assert [m["step"] for m in read_metrics(failed)] == [1] and os.path.isdir(f"{failed}/global_step_1")
    assert not os.path.exists(f"{failed}/global_step_2")
    resumed = str(tmp_path / "resumed")
    shutil.copytree(failed, resumed)
    Path(resumed, ".fsdptrain.lock").unlink(missing_ok=True)
    torchrun(2, "fsdptrain.grpo_trainer", args(resumed, reward_server))
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
        assert [m[key] for m in read_metrics(resumed)] == pytest.approx([m[key] for m in read_metrics(undisturbed)], rel=1e-6), key
