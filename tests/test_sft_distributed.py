"""The real CLI under torchrun (gloo, CPU): the same numbers whatever the layout, and a full short run."""

import os
import subprocess
import sys

import pytest

from conftest import REPO, assert_same_run, hf_weights, losses, read_metrics, run_sft, save_tiny_model, sft_args

SAVE_HF = "[model,optimizer,extra,hf_model]"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama, chat_data):
    """One process, micro-batches of 4 samples (a sample count, as verl cuts them): two per step."""
    out = str(tmp_path_factory.mktemp("dp1"))
    run_sft(1, tiny_llama, chat_data, out, data__micro_batch_size_per_gpu=4, data__use_dynamic_bsz="false",
            trainer__checkpoint__save_contents=SAVE_HF)
    return out


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (2, {"data__micro_batch_size_per_gpu": 4, "data__use_dynamic_bsz": "false"}),  # dp=2: one micro-batch per rank
        pytest.param(2, {"data__micro_batch_size_per_gpu": 1, "data__use_dynamic_bsz": "false"}, marks=pytest.mark.slow),  # four per rank
        pytest.param(2, {"data__use_dynamic_bsz": "true", "data__max_token_len_per_gpu": 300}, marks=pytest.mark.slow),  # by a token budget
        # the default: packed up to 1 x max_length tokens, not 1 sample
        pytest.param(2, {"data__micro_batch_size_per_gpu": 1}, marks=pytest.mark.slow),
        (2, {"use_remove_padding": "false"}),  # padded batches through sdpa
        pytest.param(2, {"model__fsdp_config__cpu_offload": "true", "model__enable_gradient_checkpointing": "true"}, marks=pytest.mark.slow),
    ],
    ids=["dp2", "dp2-mb1", "dp2-dynamic", "dp2-default-token-budget", "dp2-padded", "dp2-offload-checkpointing"],
)
def test_layouts_agree_with_balanced_tokens(tmp_path, tiny_llama, chat_data, reference, nproc, overrides):
    out = str(tmp_path)
    run_sft(nproc, tiny_llama, chat_data, out, trainer__checkpoint__save_contents=SAVE_HF, **overrides)
    assert_same_run(out, reference)


@pytest.mark.slow
def test_verls_launch_starts_its_own_workers(tmp_path, tiny_llama, chat_data, reference):
    """`python -m fsdptrain.sft_trainer trainer.n_gpus_per_node=2`, as verl launches, without torchrun: two workers
    started by torch's elastic agent in that process (a worker's config check fails unless the world is 2), a dp=2
    run that trains as one process does."""
    out = str(tmp_path)
    args = sft_args(tiny_llama, chat_data, out, data__micro_batch_size_per_gpu=4, data__use_dynamic_bsz="false",
                    trainer__checkpoint__save_contents=SAVE_HF, trainer__n_gpus_per_node=2)
    result = subprocess.run([sys.executable, "-m", "fsdptrain.sft_trainer", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(out, reference)


def test_several_nodes_are_left_to_torchrun(tmp_path, tiny_llama, chat_data):
    args = sft_args(tiny_llama, chat_data, str(tmp_path), trainer__nnodes=2, trainer__n_gpus_per_node=2)
    result = subprocess.run([sys.executable, "-m", "fsdptrain.sft_trainer", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["fsdptrain: trainer.nnodes=2: several nodes are launched by torchrun on each, with "
                                                  "--nnodes=2 --nproc_per_node=2 (docs/multinode.md)"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, sp, fsdp_size", [(4, 1, 2), (8, 2, 4)], ids=["4-as-2x2", "8-as-2x2xsp2"])
def test_hybrid_sharding_trains_as_sharding_over_every_rank(tmp_path, tiny_llama, chat_data, nproc, sp, fsdp_size):
    """verl's fsdp_size: the model sharded over groups of fsdp_size ranks and replicated across them (HSDP) trains
    as sharded over every rank: 4 processes as 2 x 2 against 4 x 1; 8 as 2 replicas x 2 shards x Ulysses 2 against
    Ulysses alone. Losses, gradient norms and final weights to 1e-6."""
    runs = {}
    for size in (-1, fsdp_size):
        runs[size] = str(tmp_path / str(size))
        run_sft(nproc, tiny_llama, chat_data, runs[size], ulysses_sequence_parallel_size=sp, model__fsdp_config__fsdp_size=size,
                trainer__checkpoint__save_contents=SAVE_HF)
    hybrid, full = read_metrics(runs[fsdp_size]), read_metrics(runs[-1])
    assert [m["train/loss"] for m in hybrid] == pytest.approx([m["train/loss"] for m in full], abs=1e-6)
    assert_same_run(runs[fsdp_size], runs[-1], atol=1e-6, grad_rtol=1e-6)


@pytest.mark.slow
def test_untied_embedding_in_its_own_fsdp_group(tmp_path, tokenizer, chat_data):
    """An untied input embedding (as in Qwen2-7B, Llama-3) is sharded as a group of its own: dp=2 with
    resharding after forward still trains exactly as one process does."""
    model = save_tiny_model(tmp_path / "untied", "qwen2", tokenizer, tie_word_embeddings=False)
    runs = {nproc: str(tmp_path / f"dp{nproc}") for nproc in (1, 2)}
    for nproc, out in runs.items():
        run_sft(nproc, model, chat_data, out, data__micro_batch_size_per_gpu=4, trainer__checkpoint__save_contents=SAVE_HF,
                model__fsdp_config__reshard_after_forward="true")
    assert_same_run(runs[2], runs[1])
    assert "lm_head.weight" in hf_weights(os.path.join(runs[2], "global_step_3"))


def test_unbalanced_mode_logs_the_token_mean_but_weighs_micro_batches(tmp_path, tiny_llama, chat_data, reference):
    out = str(tmp_path)
    run_sft(2, tiny_llama, chat_data, out, data__balance_dp_token="false", data__micro_batch_size_per_gpu=1)
    balanced, unbalanced = losses(reference), losses(out)
    assert unbalanced[0] == pytest.approx(balanced[0], rel=1e-6)  # same weights before the first update (fp32 sums in another order)
    assert abs(unbalanced[2] - balanced[2]) > 1e-4  # per-micro-batch means weigh tokens differently


@pytest.mark.slow
def test_ten_step_run(tmp_path, tiny_llama, chat_data):
    out = str(tmp_path)
    result = run_sft(
        2, tiny_llama, chat_data, out,
        trainer__total_training_steps=10, trainer__test_freq=5, trainer__logger='["console","file"]',
        model__enable_gradient_checkpointing="true", optim__lr_warmup_steps_ratio=0.1, trainer__profile_step=3,
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert [m["step"] for m in metrics if "val/loss" in m] == [5, 10]
    assert metrics[-1]["val/loss"] < metrics[4]["val/loss"]
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"] - 0.3
    for key in ("train/grad_norm", "train/lr", "perf/tokens_per_sec", "perf/max_memory_gb"):
        assert all(key in m for m in metrics), key
    assert result.stdout.count("step 1 |") == 1  # rank 0 alone prints
    for speedup in ("FSDP2 collectives as gloo send/recv", "tied embedding gradient added in place", "glibc keeps freed memory"):
        assert result.stdout.count(f"cpu speed-up on: {speedup}") == 1, speedup  # once, from rank 0
    assert os.path.isfile(os.path.join(out, "global_step_10", "meta.json"))
    profile = os.path.join(out, "profile")
    assert sorted(os.listdir(profile)) == [f"step3_rank{r}.{ext}" for r in (0, 1) for ext in ("json", "txt")]
    with open(os.path.join(profile, "step3_rank0.txt")) as f:
        assert "aten::mm" in f.read()  # the step's matmuls were recorded


@pytest.mark.slow
def test_every_logger(tmp_path, tiny_llama, chat_data):
    out = str(tmp_path)
    result = run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=2,
                     trainer__logger='["console","file","wandb","tensorboard"]')
    assert result.stdout.count("train/loss") == 2
    assert "point-to-point collectives not used: one rank has nothing to exchange" in result.stdout
    assert len(read_metrics(out)) == 2
    assert os.listdir(os.path.join(out, "tensorboard"))  # event files
    assert any(name.startswith("offline-run") for name in os.listdir(os.path.join(out, "wandb")))


def test_each_cpu_speedup_has_its_own_switch(tmp_path, tiny_llama, chat_data):
    off = {f"trainer__cpu_speedups__{name}": "false" for name in ("point_to_point_collectives", "tied_embedding_grad_in_place")}
    result = run_sft(2, tiny_llama, chat_data, str(tmp_path), trainer__total_training_steps=1, trainer__logger="[console]", **off)
    assert "cpu speed-up on: glibc keeps freed memory" in result.stdout
    assert "FSDP2 collectives" not in result.stdout and "tied embedding" not in result.stdout
