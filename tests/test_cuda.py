"""The GPU paths (CUDA, nccl, bf16, varlen flash attention, CPU offload) against their CPU references.

Skipped where there is no GPU (CI); run on a GPU machine with `python -m pytest tests/test_cuda.py`.
"""

import pytest
import torch
import torch.nn.functional as F
from test_ppo import EVERY_OFFLOAD

from fsdptrain.models import attention
from fsdptrain.models.loss import chunked_cross_entropy_sum
from fsdptrain.rl.rollout.hf import HFRollout

from conftest import losses, read_metrics, run_sft, torchrun
from test_grpo import grpo_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [1, 37, 300, 5, 128, 64]
CU_SEQLENS = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def reference_attention(q, k, v, lengths):
    """fp32 CPU attention of each sequence alone, KV heads repeated for GQA."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (a, b, c)), is_causal=True).transpose(0, 1)
           for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_attention_on_cuda_matches_fp32_reference(dtype):
    """bf16 takes a varlen flash kernel (where torch or flash-attn has one), fp32 per-sequence SDPA; both keep
    the sequences apart, forward and backward."""
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(total, heads, 64, generator=g) for heads in (8, 2, 2))
    grad_out = torch.randn(total, 8, 64, generator=g)

    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*cpu, LENGTHS)
    expected_grads = torch.autograd.grad(expected, cpu, grad_out)

    cuda = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out = attention.attend_packed(*cuda, CU_SEQLENS.cuda(), scaling=None)
    grads = torch.autograd.grad(out, cuda, grad_out.to("cuda", dtype))
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float().cpu(), expected, **tol)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float().cpu(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_prompt_attention_on_cuda_matches_the_cpu_path(dtype):
    """Sequences with fewer queries than keys (responses after a shared prompt) take a bottom-right causal mask on
    the varlen kernels as on the CPU path (which test_packed.py checks against transformers)."""
    g = torch.Generator().manual_seed(0)
    query_lengths, key_lengths = [40, 3, 17, 1], [40, 43, 57, 41]  # a prompt, then three responses that see it
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (query_lengths, key_lengths))
    q = torch.randn(sum(query_lengths), 8, 64, generator=g)
    k, v = (torch.randn(sum(key_lengths), 2, 64, generator=g) for _ in range(2))
    expected = attention.attend_packed(q, k, v, cu_q, scaling=None, cu_seqlens_k=cu_k)
    out = attention.attend_packed(*(t.to("cuda", dtype) for t in (q, k, v)), cu_q.cuda(), scaling=None, cu_seqlens_k=cu_k.cuda())
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.float().cpu(), expected, **tol)


def test_bf16_takes_a_varlen_kernel():
    """On a torch with varlen_attn (2.10+), bf16 packed attention must not fall back to the per-sequence loop."""
    if attention.varlen_attn is None and attention.flash_attn_varlen_func is None:
        pytest.skip("this torch has no varlen kernel and flash-attn is not installed")
    q, k, v = (torch.randn(sum(LENGTHS), h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention.attend_packed(q, k, v, CU_SEQLENS.cuda(), scaling=None)
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" not in names, names


def test_chunked_cross_entropy_on_cuda_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3000, 64, generator=g).cuda().requires_grad_()
    weight = torch.randn(5000, 64, generator=g).cuda().requires_grad_()
    labels = torch.randint(0, 5000, (3000,), generator=g).cuda()
    labels[::4] = -100
    full = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")
    chunked = chunked_cross_entropy_sum(hidden, weight, labels, 1024)
    torch.testing.assert_close(chunked, full, atol=1e-2, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(chunked, (hidden, weight)), torch.autograd.grad(full, (hidden, weight))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


CUDA_FP32 = dict(trainer__device="cuda", model__fsdp_config__mixed_precision__param_dtype="fp32", optim__lr_scheduler="constant")


@pytest.fixture(scope="module")
def cuda_fp32_run(tmp_path_factory, tiny_llama, chat_data):
    out = str(tmp_path_factory.mktemp("cuda_fp32"))
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=4, **CUDA_FP32)
    return out


def test_cuda_nccl_run_matches_cpu_gloo(tmp_path, tiny_llama, chat_data, cuda_fp32_run):
    """The same fp32 run on CUDA (nccl) and on CPU (gloo): the same losses up to kernel rounding."""
    run_sft(1, tiny_llama, chat_data, str(tmp_path), trainer__total_training_steps=4,
            **{**CUDA_FP32, "trainer__device": "cpu"})
    assert losses(cuda_fp32_run) == pytest.approx(losses(str(tmp_path)), abs=1e-4)


def test_cuda_offload_and_checkpointing_match(tmp_path, tiny_llama, chat_data, cuda_fp32_run):
    run_sft(1, tiny_llama, chat_data, str(tmp_path), trainer__total_training_steps=4, model__fsdp_config__cpu_offload="true",
            model__enable_gradient_checkpointing="true", **CUDA_FP32)
    assert losses(str(tmp_path)) == pytest.approx(losses(cuda_fp32_run), abs=1e-5)


@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_activation_offload_trains_the_same(tmp_path, tiny_llama, chat_data, cuda_fp32_run, checkpointing):
    """enable_activation_offload: each layer's checkpointed input (or, without checkpointing, everything it saves)
    waits in host memory; the losses are the run's without it."""
    run_sft(1, tiny_llama, chat_data, str(tmp_path), trainer__total_training_steps=4, model__enable_activation_offload="true",
            model__enable_gradient_checkpointing=checkpointing, **CUDA_FP32)
    assert losses(str(tmp_path)) == pytest.approx(losses(cuda_fp32_run), abs=1e-5)


def test_cuda_resume_matches_the_straight_run(tmp_path, tiny_llama, chat_data, cuda_fp32_run):
    out = str(tmp_path / "run")
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=2, trainer__save_freq=2, **CUDA_FP32)
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=4, **CUDA_FP32)
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert losses(out) == pytest.approx(losses(cuda_fp32_run), abs=1e-5)


def test_bf16_run_learns_and_stays_near_fp32(tmp_path, tiny_llama, chat_data, cuda_fp32_run):
    """bf16 mixed precision (the default) with packed varlen attention and gradient checkpointing."""
    out = str(tmp_path)
    run_sft(1, tiny_llama, chat_data, out, trainer__total_training_steps=4, trainer__device="cuda", optim__lr_scheduler="constant",
            model__enable_gradient_checkpointing="true")
    bf16, fp32 = losses(out), losses(cuda_fp32_run)
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16[-1] < bf16[0]
    assert read_metrics(out)[-1]["perf/max_memory_gb"] > 0


def test_liger_kernels_give_the_losses_of_transformers_modules(tmp_path, tiny_llama, chat_data, cuda_fp32_run):
    """model.use_liger=true: liger's RMSNorm, rotary and SwiGLU kernels in the packed fp32 run, the losses of the
    run with transformers' own modules."""
    pytest.importorskip("liger_kernel")
    result = run_sft(1, tiny_llama, chat_data, str(tmp_path), trainer__total_training_steps=4, model__use_liger="true", **CUDA_FP32)
    assert "liger's kernels in the llama model: rope, rms_norm, swiglu" in result.stdout
    assert losses(str(tmp_path)) == pytest.approx(losses(cuda_fp32_run), abs=1e-4)


@pytest.mark.parametrize("liger", ["false", "true"])
def test_grpo_runs_on_cuda_with_the_engine_agreeing(tmp_path, tiny_llama, rl_data, liger):
    """Two GRPO steps on CUDA in bf16 (the default) with the HF engine's sampling log-probs: the trainer's
    old-policy log-probs agree with them to bf16 precision, and the update moves the weights; with liger's kernels
    (where installed) too."""
    if liger == "true":
        pytest.importorskip("liger_kernel")
    out = str(tmp_path)
    result = torchrun(1, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, trainer__device="cuda",
                                                             algorithm__rollout_correction__rollout_is="token", actor_rollout_ref__model__use_liger=liger))
    assert ("liger's kernels in the llama model" in result.stdout) == (liger == "true")
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert 0.9 < m["rollout_corr/rollout_is_min"] <= m["rollout_corr/rollout_is_max"] < 1.1
        assert m["actor/grad_norm"] > 0 and m["perf/max_memory_gb"] > 0


def test_hf_engine_sleeps_off_the_gpu_and_wakes_unchanged(tiny_llama):
    """Asleep, the HF engine's weights' bytes leave the GPU for pinned host buffers; awake, they are back bit for bit (greedy answers too), and a
    second sleep reuses the first one's host buffers; weights sent after waking are the ones it generates with.
    With free_cache_engine=false it stays on the GPU."""
    engine = HFRollout(tiny_llama, torch.device("cuda"), torch.bfloat16, pad_id=0)
    prompts = [[5, 6, 7, 8], [9, 10]]

    def answers():
        return [g.response_ids for g in engine.generate(prompts, n=1, max_new_tokens=8, batch_size=2, do_sample=False)]

    before = {name: t.clone() for name, t in engine.model.state_dict().items()}
    greedy, awake_bytes = answers(), torch.cuda.memory_allocated()
    weight_bytes = sum(t.numel() * t.element_size() for t in engine._tensors())
    for _ in range(2):
        engine.sleep()
        assert all(t.untyped_storage().nbytes() == 0 for t in engine._tensors())
        assert all(b.is_pinned() for b in engine.parked.buffers)
        assert torch.cuda.memory_allocated() <= awake_bytes - weight_bytes * 0.9
        parked = [b.data_ptr() for b in engine.parked.buffers]
        engine.wake_up()
        assert [b.data_ptr() for b in engine.parked.buffers] == parked
        assert all(torch.equal(t, before[name]) and t.is_cuda for name, t in engine.model.state_dict().items())
        assert answers() == greedy
    engine.sleep()
    engine.wake_up()
    engine.update_weights([("model.norm.weight", torch.zeros_like(engine.model.model.norm.weight))])
    assert all(set(answer) == {0} for answer in answers())  # all-zero logits: the argmax is token 0
    kept = HFRollout(tiny_llama, torch.device("cuda"), torch.bfloat16, pad_id=0, free_cache_engine=False)
    kept.sleep()
    assert all(t.is_cuda for t in kept.model.state_dict().values())


def test_offload_between_phases_frees_the_device_and_trains_the_same(tiny_llama):
    """verl's param_offload / optimizer_offload (distributed/offload.py): each departure frees the parameter shards'
    device memory and, once AdamW has state, its two moments'; three steps with the moves equal three without, bit
    for bit (tests/checks/offload_check.py)."""
    result = torchrun(1, "tests.checks.offload_check", [tiny_llama])
    assert "offload check passed" in result.stdout


def test_grpo_with_every_offload_key_runs_on_cuda(tmp_path, tiny_llama, rl_data):
    """The actor's, the reference's and the critic's offload keys in a PPO run with a KL loss on CUDA: it trains, and
    its first step's losses are those of the run without them."""
    ppo = dict(algorithm__adv_estimator="gae", actor_rollout_ref__rollout__n=1, actor_rollout_ref__actor__use_kl_loss="true", trainer__device="cuda",
               actor_rollout_ref__actor__fsdp_config__mixed_precision__param_dtype="fp32", trainer__critic_warmup=0)
    runs = {}
    for name, extra in (("plain", {}), ("offloaded", EVERY_OFFLOAD)):
        out = str(tmp_path / name)
        torchrun(1, "fsdptrain.grpo_trainer", grpo_args(tiny_llama, rl_data, out, **ppo, **extra))
        runs[name] = read_metrics(out)
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
        assert runs["offloaded"][0][key] == pytest.approx(runs["plain"][0][key], abs=1e-6), key
    assert runs["offloaded"][1]["perf/memory_at_gen_gb"] < runs["plain"][1]["perf/memory_at_gen_gb"]  # AdamW's moments exist from step 2
