"""Asynchronous RL as verl 0.9's v1 trainer (docs/async.md): in separate_async, standalone rollout ranks generate
ahead of the training ranks; in colocate_async, every rank keeps its unfinished responses in flight across steps;
the policy version of every trained group bounded by max_off_policy_threshold. Exact against the synchronous run at
a lag of 0 (separate_async) and with nothing in flight (colocate_async); the lag bound checked from the rollout
dumps, each token's sampling log-prob against a plain forward of the weights that drew it."""

import json
import os
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from test_ownership import restarted_run

from fsdptrain.config.verl_keys import translate
from fsdptrain.distributed.mesh import World
from fsdptrain.errors import ConfigError
from fsdptrain.trainer.grpo_plan import read_grpo_config

from conftest import REPO, assert_same_weights, hf_weights, read_metrics, torchrun
from test_grpo import grpo_args

SEPARATE = {"trainer__v1__trainer_mode": "separate_async", "actor_rollout_ref__rollout__nnodes": 1}


def run(nproc: int, model: str, data, out: str, **overrides) -> list[dict]:
    """A GRPO run on `nproc` processes; none: launched as verl launches, the trainer starting its own workers."""
    settings = {"data__val_files": "null", "trainer__total_training_steps": 3, "trainer__rollout_data_dir": f"{out}/rollouts",
                "trainer__save_freq": -1, "trainer__checkpoint__save_contents": "[hf_model]", **overrides}
    if nproc:
        torchrun(nproc, "fsdptrain.grpo_trainer", grpo_args(model, data, out, **settings))
    else:
        env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        subprocess.run([sys.executable, "-m", "fsdptrain.grpo_trainer", *grpo_args(model, data, out, **settings)], cwd=REPO,
                       env={**env, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True, timeout=600)
    return read_metrics(out)


def problems(processes: int, *overrides: str) -> str:
    """The ConfigError of a GRPO config with `overrides` on `processes` CPU processes, or "" where it loads."""
    with initialize_config_module(config_module="fsdptrain.config", version_base=None):
        try:
            read_grpo_config(compose(config_name="grpo_trainer", overrides=["data.train_files=x.parquet", "actor_rollout_ref.model.path=m",
                                                                             "trainer.v1.trainer_mode=separate_async", *overrides]),
                             world=World(0, processes, processes, torch.device("cpu")))
        except ConfigError as error:
            return str(error)
    return ""


def test_impossible_splits_and_what_is_not_built_are_refused_before_any_process_starts():
    """verl's rule for parameter_sync_step, a placement that leaves no training rank or splits the training ranks
    unevenly between the rollout ranks, the engines and modes not built: each named with its keys."""
    pool = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]
    fits = ["trainer.v1.separate_async.parameter_sync_step=1", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    assert "actor_rollout_ref.rollout.nnodes and actor_rollout_ref.rollout.n_gpus_per_node" in problems(2, *fits)
    assert "data.train_batch_size (4) must equal trainer.v1.separate_async.parameter_sync_step (4) x actor_rollout_ref.actor" in problems(
        2, *pool, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    assert "1 rollout ranks (actor_rollout_ref.rollout.nnodes x n_gpus_per_node) leave none of the 1 processes" in problems(1, *pool, *fits)
    assert "the 2 rollout ranks must divide the 3 training ranks" in problems(5, "actor_rollout_ref.rollout.nnodes=1",
                                                                              "actor_rollout_ref.rollout.n_gpus_per_node=2", *fits)
    assert "tensor_model_parallel_size=2: each standalone rollout rank runs an engine of its own" in problems(
        3, *pool, *fits, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert problems(2, *pool, *fits, "actor_rollout_ref.rollout.name=vllm") == ""
    assert "hybrid sharding (actor_rollout_ref.actor.fsdp_config.fsdp_size=2) is not built yet" in problems(
        5, *pool, *fits, "actor_rollout_ref.actor.fsdp_config.fsdp_size=2")
    colocate = ["trainer.v1.trainer_mode=colocate_async"]
    assert "colocate_async with actor_rollout_ref.rollout.multi_turn.enable=true is not built" in (
        problems(2, *colocate, "actor_rollout_ref.rollout.multi_turn.enable=true"))
    assert problems(2, *colocate, "trainer.v1.sampler.max_off_policy_strategy=wait") == ""
    assert "colocate_async with actor_rollout_ref.rollout.name=vllm is not built" in problems(2, *colocate, "actor_rollout_ref.rollout.name=vllm")
    assert problems(2, *colocate) == ""
    assert "asks for standalone rollout ranks, which only trainer.v1.trainer_mode=separate_async" in problems(
        2, *pool, "trainer.use_v1=false")
    assert problems(2, *pool, *fits) == ""


def test_the_launch_shape_counts_the_rollout_ranks_apart():
    """verl's trainer.n_gpus_per_node is the training ranks'; the rollout ranks default to as many, as in verl."""
    given = ["trainer.n_gpus_per_node=2", "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.rollout.nnodes=1"]
    kept, found = translate(given, "grpo", 4)
    assert found == [] and "actor_rollout_ref.rollout.n_gpus_per_node=2" in kept
    _, found = translate(given, "grpo", 2)
    assert found == ["trainer.nnodes (1) x trainer.n_gpus_per_node (2) must equal the number of processes torchrun started (2) less the 2 "
                     "rollout ranks (actor_rollout_ref.rollout.nnodes x n_gpus_per_node): launch with 2 + 2 processes, or fix the keys"]


def dumped(out: str) -> dict[int, list[dict]]:
    return {int(name.removesuffix(".jsonl")): [json.loads(line) for line in open(os.path.join(out, "rollouts", name))]
            for name in os.listdir(os.path.join(out, "rollouts")) if name.endswith(".jsonl")}


@pytest.fixture(scope="module")
def eos_llama(tmp_path_factory, tiny_llama) -> str:
    """The tiny Llama given an end-of-sequence output row, so that its responses end at different lengths (the
    plain tiny model runs every response to the length limit)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 3 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("eos_llama")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory, eos_llama, rl_data):
    """The synchronous run on 1 and 2 ranks (3 steps, saved at the last), made once each when first asked for."""
    made = {}

    def sync_run(ranks: int) -> tuple[str, list[dict]]:
        if ranks not in made:
            out = str(tmp_path_factory.mktemp(f"sync{ranks}"))
            made[ranks] = out, run(ranks, eos_llama, rl_data, out, trainer__save_freq=3)
        return made[ranks]

    return sync_run


def assert_the_synchronous_run(out: str, metrics: list[dict], sync_out: str, sync: list[dict]) -> None:
    """The same responses, rewards, losses, gradient norms and final weights, every group generated by the policy
    that trains on it."""
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
        assert [m[key] for m in metrics] == pytest.approx([m[key] for m in sync], rel=1e-6, abs=1e-7), key
    assert [m["async/staleness/max"] for m in metrics] == [0, 0, 0]
    for step, rows in dumped(out).items():
        reference = dumped(sync_out)[step]
        assert [r["response_ids"] for r in rows] == [r["response_ids"] for r in reference]
        assert {r["policy_version"] for r in rows} == {step - 1}
    assert_same_weights(hf_weights(os.path.join(out, "global_step_3")), hf_weights(os.path.join(sync_out, "global_step_3")), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("training_ranks", [1, 2])
def test_separate_rollout_ranks_at_lag_zero_are_the_synchronous_run(tmp_path, eos_llama, rl_data, sync_runs, training_ranks):
    """T training ranks with T rollout ranks (parameter_sync_step 1, max_off_policy_threshold 0, wait, a batch asked
    for ahead) against the synchronous run on T ranks, fp32, same seed: the same responses, rewards, losses, gradient
    norms and final weights, every trained group generated by the policy that trains on it. 1 + 1 is launched as
    verl launches (`python -m ... trainer.n_gpus_per_node=1`, the rollout ranks as many), 2 + 2 under torchrun."""
    # 1 + 1 as verl launches (the rollout ranks as many as trainer.n_gpus_per_node), 2 + 2 under torchrun
    shape = {"trainer__n_gpus_per_node": 1} if training_ranks == 1 else {"actor_rollout_ref__rollout__n_gpus_per_node": 2}
    out = str(tmp_path / "separate")
    separate = run(0 if training_ranks == 1 else 4, eos_llama, rl_data, out, **SEPARATE, **shape, trainer__save_freq=3,
                   trainer__v1__separate_async__parameter_sync_step=1, trainer__v1__sampler__max_off_policy_threshold=0,
                   trainer__v1__sampler__max_off_policy_strategy="wait")
    assert_the_synchronous_run(out, separate, *sync_runs(training_ranks))


@pytest.mark.slow
@pytest.mark.parametrize("nothing_ahead", [{"trainer__v1__colocate_async__num_warmup_batches": 0},
                                           {"trainer__v1__sampler__max_off_policy_strategy": "wait", "trainer__v1__sampler__max_off_policy_threshold": 0}],
                         ids=["no-warmup-batches", "wait-at-threshold-0"])
def test_colocate_async_with_nothing_in_flight_is_the_synchronous_run(tmp_path, eos_llama, rl_data, sync_runs, nothing_ahead):
    """colocate_async on 2 ranks with no batch in flight ahead (num_warmup_batches 0, or a batch asked ahead but
    `wait` at threshold 0) and a generation batch that holds a rank's share: each step finishes its batch's responses
    under its own weights, as the sync mode does."""
    out = str(tmp_path / "colocate")
    colocate = run(2, eos_llama, rl_data, out, trainer__v1__trainer_mode="colocate_async", **nothing_ahead, trainer__save_freq=3)
    assert [m["async/in_flight_groups"] for m in colocate] == [0, 0, 0]
    assert_the_synchronous_run(out, colocate, *sync_runs(2))


@pytest.mark.slow
def test_the_rollout_ranks_run_ahead_within_the_lag_bound_and_survive_lost_ranks(tmp_path, tiny_llama, rl_data):
    """An epoch (8 batches of 4 prompts) on one training and one rollout rank, four updates a step
    (parameter_sync_step 4), three batches asked for ahead and max_off_policy_threshold 2, under torchrun
    --max-restarts=2: the training rank killed in step 3's update, then (resumed from the checkpoint before) the
    rollout rank killed as it starts step 6's batch. The run finishes, and read from its dumps: every batch of the
    epoch was trained once, by the step it belongs to (the resumed run asks for the batches after its checkpoint
    again: docs/async.md); no group lags the policy that trains on it by more than 2 versions, and the bound is
    reached (the rollout rank does run ahead); the logged lag is the dumps'; each response's tokens carry the
    versions that drew them, in order, from its group's."""
    args = grpo_args(tiny_llama, rl_data, "unused", data__val_files="null", trainer__total_training_steps="null", trainer__save_freq=1,
                     trainer__checkpoint__save_contents="[model,optimizer,extra]", trainer__rollout_data_dir=f"{tmp_path}/restarted/rollouts",
                     actor_rollout_ref__rollout__n_gpus_per_node=1, actor_rollout_ref__actor__ppo_mini_batch_size=1,
                     trainer__v1__separate_async__parameter_sync_step=4, trainer__v1__separate_async__num_warmup_batches=3,
                     trainer__v1__sampler__max_off_policy_threshold=2, **SEPARATE)
    out = restarted_run(tmp_path, "fsdptrain.grpo_trainer", [a for a in args if not a.startswith("trainer.default_local_dir=")],
                        ["update_actor@3:0", "rollout@6:1"])
    rows = dumped(out)
    assert sorted(rows) == list(range(1, 9))
    lags = {}
    for step, dump in rows.items():
        assert {r["batch"] for r in dump} == {step - 1} and len(dump) == 16
        lags[step] = max(step - 1 - r["policy_version"] for r in dump)
        for r in dump:  # a response continued under newer weights (partial rollouts) starts with its group's version
            versions = r["token_versions"]
            assert versions == sorted(versions) and versions[0] == r["policy_version"] and versions[-1] <= step - 1
    prompts = [json.dumps(r["prompt"]) for step in sorted(rows) for r in rows[step][::4]]
    assert len(set(prompts)) == 32
    assert max(lags.values()) == 2 and min(lags.values()) >= 0
    logged = {m["step"]: m["async/staleness/max"] for m in read_metrics(out)}
    assert logged == lags


@pytest.mark.slow
def test_a_vllm_rollout_rank_samples_the_weights_sent(tmp_path, rl_data, vllm_llama):
    """separate_async with vLLM on the rollout rank (its engine in a process of its own: rl/rollout/engine_process.py),
    1 + 1 at a lag of 0 and a large learning rate: each batch trained once by its own step, and every step's
    responses sampled from the weights that train on them (the ratios of vLLM's sampling probabilities to the
    trainer's old ones within 1e-4 of 1, after updates that move them by far more). A lost rollout rank is the hf
    test's above; its engine's process ends with it (the next test)."""
    pytest.importorskip("vllm")
    out = str(tmp_path / "run")
    metrics = run(2, vllm_llama, rl_data, out, trainer__total_training_steps=2, actor_rollout_ref__rollout__name="vllm",
                  actor_rollout_ref__rollout__gpu_memory_utilization=0.1, actor_rollout_ref__actor__optim__lr="1e-2",
                  algorithm__rollout_correction__rollout_is="token", actor_rollout_ref__rollout__n_gpus_per_node=1,
                  trainer__v1__separate_async__parameter_sync_step=1, trainer__v1__sampler__max_off_policy_threshold=0,
                  trainer__v1__sampler__max_off_policy_strategy="wait", **SEPARATE)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[0]["actor/grad_norm"] > 0.1
    for m in metrics:  # the probabilities themselves are tiny (a random model over the tokenizer's 49,152 rows): their ratios
        assert 1 - 1e-4 < m["rollout_corr/rollout_is_min"] <= m["rollout_corr/rollout_is_max"] < 1 + 1e-4
    rows = dumped(out)
    assert {step: {(r["batch"], r["policy_version"]) for r in dump} for step, dump in rows.items()} == {s: {(s - 1, s - 1)} for s in (1, 2)}


def test_the_check_says_which_ranks_train_and_which_generate(capsys, tiny_llama, rl_data):
    from fsdptrain.check import main

    args = grpo_args(tiny_llama, rl_data, "unused", **SEPARATE, actor_rollout_ref__rollout__n_gpus_per_node=2, trainer__v1__separate_async__parameter_sync_step=1)
    assert main(["grpo", "--nproc-per-node", "4", "--device", "cpu", *args]) == 0
    out = capsys.readouterr().out
    assert "data-parallel 2 x sequence-parallel 1" in out
    assert "placement (separate_async): ranks 0-1 train, ranks 2-3 generate (1 training rank(s) each); 1 batch(es) asked for ahead" in out
    args = grpo_args(tiny_llama, rl_data, "unused", trainer__v1__trainer_mode="colocate_async")
    assert main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
    assert ("placement (colocate_async): every rank generates and trains; its unfinished responses stay in flight across steps, 1 batch(es) "
            "in flight ahead, a trained group's lag at most 8 version(s), a staler one dropped") in capsys.readouterr().out
    args = grpo_args(tiny_llama, rl_data, "unused", trainer__v1__trainer_mode="colocate_async", trainer__v1__colocate_async__num_warmup_batches=2,
                     trainer__v1__sampler__max_off_policy_strategy="wait", trainer__v1__sampler__max_off_policy_threshold=1)
    assert main(["grpo", "--nproc-per-node", "2", "--device", "cpu", *args]) == 0
    assert "1 batch(es) in flight ahead, a trained group's lag at most 1 version(s), each step waiting for its own batch's groups" in capsys.readouterr().out


def test_a_response_goes_on_under_the_weights_that_come_while_it_is_drawn(tiny_llama):
    """Partial rollouts in the hf engine's decoding: new weights taken after the third token; each token's
    sampling log-prob is the log-softmax of a plain forward of the model whose weights drew it (version 0: the
    pretrained model; version 1: another), given the whole prefix, and each token is tagged with that version."""
    from transformers import AutoModelForCausalLM

    from fsdptrain.rl.rollout.hf import WeightsRefresh, end_token_ids, generate

    first = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    second = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    engine = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    calls = []

    def load() -> int | None:
        calls.append(1)
        if len(calls) != 3:
            return None
        with torch.no_grad():
            for mine, theirs in zip(engine.parameters(), second.parameters()):
                mine.copy_(theirs)
        return 1

    torch.manual_seed(0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    generations = generate(engine, prompts, n=2, max_new_tokens=8, batch_size=4, end_ids=end_token_ids(engine, 0), pad_id=0,
                           calculate_log_probs=True, refresh=WeightsRefresh(load, 0))
    assert {tuple(g.versions) for g in generations} == {(0, 0, 0, 1, 1, 1, 1, 1)}
    for g in generations:
        ids = torch.tensor(g.prompt_ids + g.response_ids)[None]
        with torch.no_grad():
            by_version = [model(ids).logits[0, len(g.prompt_ids) - 1 : -1].log_softmax(-1) for model in (first, second)]
        expected = [by_version[v][i, token] for i, (v, token) in enumerate(zip(g.versions, g.response_ids))]
        assert torch.tensor(g.log_probs) == pytest.approx(torch.stack(expected), abs=1e-5)


def test_a_request_drawn_in_pieces_tags_each_group_by_the_weights_of_its_first_token(tiny_llama):
    """A rollout rank draws a request a generation batch at a time (here a group a piece), each piece under the
    newest weights it holds; weights come in the middle of the second piece and again in the third, at fixed
    points (the 12th and 20th look between two tokens, not by timing). Each group's version is its oldest token's,
    not the version the request began under, and so the staleness logged and dumped from it."""
    from transformers import AutoModelForCausalLM

    from fsdptrain.rl.rollout.hf import WeightsRefresh, end_token_ids, generate
    from fsdptrain.rl.sampling import group_versions

    engine = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    looks = []

    def load() -> int | None:
        looks.append(1)
        if len(looks) not in (12, 20):
            return None
        with torch.no_grad():
            for parameter in engine.parameters():
                parameter.mul_(1.01)
        return {12: 1, 20: 2}[len(looks)]

    torch.manual_seed(0)
    refresh = WeightsRefresh(load, 0)
    # shortest first: the engine draws prompts that fill several batches in the order of their lengths
    generations = generate(engine, [[12, 13], [9, 10, 11], [5, 6, 7, 8]], n=2, max_new_tokens=8, batch_size=2,
                           end_ids=end_token_ids(engine, 0), pad_id=0, refresh=refresh)
    assert all(len(g.versions) == 8 for g in generations)  # a random model runs to the limit: 7 looks a piece
    versions = group_versions(generations, n=2, started=0)
    assert versions == [0, 0, 1]  # the third piece began under version 1; the request began under 0
    for i, version in enumerate(versions):
        assert version == min(v for g in generations[2 * i : 2 * i + 2] for v in g.versions)
    assert {v for g in generations[2:4] for v in g.versions} == {0, 1}  # the second piece: its tokens of both
    assert {v for g in generations[4:] for v in g.versions} == {1, 2}


@pytest.mark.slow
def test_a_vllm_response_goes_on_under_the_weights_that_come_while_it_is_drawn(vllm_llama):
    """Partial rollouts on a rollout rank's vLLM engine (in its own process): new weights sent while it generates
    stop its requests, are loaded, and the requests go on from their tokens so far. Each token's sampling log-prob
    is the log-softmax of a plain forward (float64) of the model whose weights drew it, given the whole prefix, and
    each token is tagged with that version. The engine's process ends when its rank's end of the pipe closes."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from fsdptrain.rl.rollout.base import EngineSpec
    from fsdptrain.rl.rollout.engine_process import EngineProcess
    from fsdptrain.rl.rollout.hf import WeightsRefresh
    from fsdptrain.rl.rollout.vllm import EngineSettings

    first = AutoModelForCausalLM.from_pretrained(vllm_llama, dtype=torch.float32).eval()
    second = AutoModelForCausalLM.from_pretrained(vllm_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    engine = EngineProcess("vllm", EngineSpec(vllm_llama, torch.float32, torch.device("cpu"), 0, False, 256, 0, 1, False,
                                              EngineSettings(gpu_memory_utilization=0.1)))
    looks = []

    def load() -> int | None:  # the second look (40 ms in): far sooner than 96 tokens are drawn
        looks.append(1)
        if len(looks) != 2:
            return None
        engine.update_weights(second.named_parameters())
        return 1

    engine.refresh = WeightsRefresh(load, 0)
    generations = engine.generate([[5, 6, 7, 8], [9, 10, 11]], n=2, max_new_tokens=96, batch_size=4, calculate_log_probs=True)
    engine.conn.close()  # as it closes when the rank dies, however it dies
    engine.process.join(timeout=60)
    assert engine.process.exitcode == 0
    assert all(len(g.response_ids) == len(g.log_probs) == len(g.versions) == 96 for g in generations)  # a random model runs to the limit
    assert all(g.versions == sorted(g.versions) and g.versions[0] == 0 and g.versions[-1] == 1 for g in generations)
    for g in generations:
        ids = torch.tensor(g.prompt_ids + g.response_ids)[None]
        with torch.no_grad():
            by_version = [model(ids).logits[0, len(g.prompt_ids) - 1 : -1].double().log_softmax(-1) for model in (first, second)]
        expected = torch.stack([by_version[v][i, token] for i, (v, token) in enumerate(zip(g.versions, g.response_ids))])
        assert torch.tensor(g.log_probs, dtype=torch.float64) == pytest.approx(expected, abs=1e-4)


def test_the_pool_trains_the_first_complete_groups_and_continues_the_rest_under_new_weights(eos_llama):
    """colocate_async's pool on one rank, batches of 4 prompts x 4 responses, one batch in flight ahead: the first
    step takes 4 complete groups, all drawn by version 0, and leaves the next batch's started; after new weights
    (version 1), the groups in flight go on under them. Every token's sampling log-prob is the log-softmax of a
    plain forward of the weights that drew it; no group is taken twice, and every group added is taken, dropped or
    still in flight. With max_off_policy_threshold 0 every group holding a version-0 token is dropped, and counted.
    With `wait`, each step takes its own batch's groups, some begun before the update, none dropped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdptrain.rl.data import Prompt
    from fsdptrain.rl.rollout.hf import HFRollout
    from fsdptrain.rl.rollout.in_flight import ResponsePool
    from fsdptrain.rl.sampling import RolloutRequest

    tokenizer = AutoTokenizer.from_pretrained(eos_llama)
    first = AutoModelForCausalLM.from_pretrained(eos_llama, dtype=torch.float32).eval()
    second = AutoModelForCausalLM.from_pretrained(eos_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    prompts = [Prompt(tokenizer(f"{a} plus {a + 1} is", add_special_tokens=False)["input_ids"], [], "arithmetic", str(2 * a + 1))
               for a in range(40)]
    request = RolloutRequest(n=4, max_new_tokens=8, batch_size=16, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, calculate_log_probs=True)

    def steps(max_lag: int | None, lead: int = 1, wait: bool = False) -> tuple[ResponsePool, list[list], list[int], set]:
        engine = HFRollout(eos_llama, torch.device("cpu"), torch.float32, tokenizer.pad_token_id or 0)
        pool = ResponsePool(None, 4, lead=lead, max_lag=max_lag, wait=wait, engine=engine, share=lambda b: prompts[4 * b : 4 * b + 4])
        torch.manual_seed(0)
        taken, dropped = [], []
        for number in range(3):
            if number == 1:
                started_under_first = {(g.batch, g.index) for g in pool.groups if any(r.tokens for r in g.responses)}
                engine.update_weights(second.named_parameters())
                pool.version = 1
            groups, count = pool.take(number, request)
            taken.append(groups)
            dropped.append(count)
        return pool, taken, dropped, started_under_first

    pool, taken, dropped, started_under_first = steps(None)
    assert [len(groups) for groups in taken] == [4, 4, 4] and dropped == [0, 0, 0]
    assert {g.oldest_version for g in taken[0]} == {0} and started_under_first  # the next batch began before step 1's update
    keys = [(g.batch, g.index) for groups in taken for g in groups]
    assert len(set(keys)) == len(keys) and len(keys) + len(pool.groups) == 4 * (pool.added_through + 1)
    continued = [r for groups in taken[1:] for g in groups for r in g.responses if len(set(r.versions)) > 1]
    assert continued  # responses begun by version 0 and finished by version 1
    for groups in taken:
        for g in groups:
            for r in g.responses:
                assert r.versions == sorted(r.versions) and len(r.log_probs) == len(r.tokens) == len(r.versions)
                ids = torch.tensor(g.prompt.ids + r.tokens)[None]
                with torch.no_grad():
                    # in float64: float32's log_softmax is 7% off for a token of probability 0.9994, which this model draws
                    by_version = [model(ids).logits[0, len(g.prompt.ids) - 1 : -1].double().log_softmax(-1) for model in (first, second)]
                expected = torch.stack([by_version[v][i, token] for i, (v, token) in enumerate(zip(r.versions, r.tokens))])
                assert torch.tensor(r.log_probs, dtype=torch.float64) == pytest.approx(expected, abs=1e-5)

    pool, taken, dropped, started_under_first = steps(0)
    assert all(g.oldest_version == 1 for groups in taken[1:] for g in groups) and [len(groups) for groups in taken] == [4, 4, 4]
    keys = [(g.batch, g.index) for groups in taken for g in groups]
    assert len(set(keys)) == len(keys) and len(keys) + sum(dropped) + len(pool.groups) == 4 * (pool.added_through + 1)
    assert not any((g.batch, g.index) in started_under_first for groups in taken[1:] for g in groups) and dropped[1] > 0

    # wait, a threshold of 1 and so one batch in flight ahead (the plan's cap): each step takes its own batch
    pool, taken, dropped, started_under_first = steps(1, lead=1, wait=True)
    assert [{g.batch for g in groups} for groups in taken] == [{0}, {1}, {2}] and [len(groups) for groups in taken] == [4, 4, 4]
    assert dropped == [0, 0, 0] and pool.added_through == 3 and {g.batch for g in pool.groups} == {3}
    assert any(g.oldest_version == 0 for g in taken[1])  # batch 1 began beside batch 0, before the update


@pytest.mark.slow
def test_colocate_async_keeps_responses_in_flight_within_the_lag_bound_and_survives_a_lost_rank(tmp_path, eos_llama, rl_data):
    """colocate_async on 2 ranks, a batch in flight ahead and max_off_policy_threshold 1, saved every step, under
    torchrun --max-restarts=1 with a rank killed in step 3's update. The run finishes, and read from its dumps:
    each step trained a batch's worth of groups, no prompt group twice (the resumed run draws the groups in flight
    at its checkpoint again, from their start), some from a later batch than the step's own and some continued
    under newer weights (tokens of two versions, in order from the group's); none lags more than 1 version and the
    logged lag is the dumps'."""
    args = grpo_args(eos_llama, rl_data, "unused", data__val_files="null", trainer__total_training_steps=6, trainer__save_freq=1,
                     trainer__checkpoint__save_contents="[model,optimizer,extra]", trainer__rollout_data_dir=f"{tmp_path}/restarted/rollouts",
                     trainer__v1__trainer_mode="colocate_async", trainer__v1__colocate_async__num_warmup_batches=1,
                     trainer__v1__sampler__max_off_policy_threshold=1, actor_rollout_ref__actor__optim__lr="1e-5")  # lengths stay varied
    out = restarted_run(tmp_path, "fsdptrain.grpo_trainer", [a for a in args if not a.startswith("trainer.default_local_dir=")],
                        ["update_actor@3:0"])
    rows = dumped(out)
    assert sorted(rows) == list(range(1, 7))
    lags, groups = {}, []
    for step, dump in rows.items():
        assert len(dump) == 16
        lags[step] = max(step - 1 - r["policy_version"] for r in dump)
        groups += [(r["batch"], json.dumps(r["prompt"])) for r in dump[::4]]
        for r in dump:
            versions = r["token_versions"]
            assert versions == sorted(versions) and versions[0] >= r["policy_version"] and versions[-1] <= step - 1
    assert len(set(groups)) == len(groups) == 24
    assert any(r["batch"] > step - 1 for step, dump in rows.items() for r in dump)
    assert any(len(set(r["token_versions"])) > 1 for dump in rows.values() for r in dump)
    assert max(lags.values()) == 1
    assert {m["step"]: m["async/staleness/max"] for m in read_metrics(out)} == lags


def test_the_scaling_model_predicts_the_three_modes_from_per_token_costs():
    """scripts/scaling_model.py --rl: sync decodes until each GPU's longest response ends; colocate_async about the
    short responses' length, over more sequences held; separate_async is the slower side at its best split; with
    no long tail and nothing ahead, colocate_async is the sync mode."""
    import argparse

    from scaling_model import rl_steps

    args = argparse.Namespace(gpus_per_node=8, prompts=256, responses=8, short_tokens=256, long_every=10, long_factor=8.0, decode_step_ms=20.0,
                              decode_seq_us=15.0, train_token_us=25.0, lead=1)
    modes = rl_steps(args)
    tokens = 2048 * (256 * 0.9 + 2048 * 0.1)
    assert modes["sync"]["gen_s"] == pytest.approx(2048 * (0.020 + 15e-6 * 256)) and modes["sync"]["train_s"] == pytest.approx(tokens * 25e-6 / 8)
    held = 256 * (2 + 7 / 10)
    assert modes["colocate_async"]["gen_s"] == pytest.approx(256 * (0.020 + 15e-6 * held))
    separate = modes["separate_async"]
    assert separate["step_s"] == max(separate["gen_s"], separate["train_s"]) and separate["step_s"] <= modes["sync"]["step_s"]
    flat = rl_steps(argparse.Namespace(**{**vars(args), "long_every": 1, "long_factor": 1.0, "lead": 0}))
    assert flat["colocate_async"]["step_s"] == pytest.approx(flat["sync"]["step_s"])
