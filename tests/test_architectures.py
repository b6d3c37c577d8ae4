"""Every architecture verl's examples name gives, on every path the trainer takes (packed rows, a shared prompt,
padded rows, the hf rollout engine), the per-token log-probs, loss and gradients of a plain transformers forward of
each sequence alone (eager attention, float32), or is refused by name before any process starts.

The tiny models (scripts/make_tiny.py's ARCHITECTURES) have sliding windows of 8 tokens, shorter than the test
sequences, so a path that drops the window (or gpt-oss's sinks, or a recurrent layer's sequence boundaries) fails."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from fsdptrain.check import main as check_main
from fsdptrain.config.shared import ModelConfig
from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import collate_packed, collate_padded
from fsdptrain.distributed.mesh import World
from fsdptrain.models.architecture import read_architecture
from fsdptrain.models.loading import build_on_meta
from fsdptrain.models.loss import token_log_probs, token_nll_sum
from fsdptrain.rl.rollout.hf import HFRollout

import make_tiny
from conftest import assert_same_run, read_metrics, run_sft, save_tiny_model, sft_args, torchrun
from test_grpo import grpo_args

ARCHITECTURES = sorted(make_tiny.ARCHITECTURES)
VOCAB = 1000
LOADING = ModelConfig(trust_remote_code=False, enable_gradient_checkpointing=False, attn_implementation="auto")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_folder(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(request.param)
    make_tiny.tiny_model(request.param, VOCAB, seed=0).save_pretrained(path)
    return str(path)


def plain(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def as_trained(path: str, packed: bool, reference: torch.nn.Module) -> torch.nn.Module:
    """The model as the trainer builds it (models/loading.build_on_meta: its attention, its recurrent layers kept
    per sequence), with the reference's weights and buffers."""
    model = build_on_meta(AutoConfig.from_pretrained(path), LOADING, packed)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied output layer a tensor of its own
    model.load_state_dict(reference.state_dict())
    buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    return model.eval()


def groups() -> list[Sample]:
    """Two prompts (19 and 6 tokens) with responses of 4, 17, 1 and 13, 5 tokens: longer than the windows."""
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt_length, response_lengths in ((19, (4, 17, 1)), (6, (13, 5))):
        prompt = torch.randint(3, VOCAB, (prompt_length,), generator=g)
        for n in response_lengths:
            ids = torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)])
            out.append(Sample(ids, (torch.arange(len(ids)) >= prompt_length).long(), {}, prompt_length))
    return out


def reference_log_probs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t+1] | ids[..t]) of a plain forward of `ids` alone."""
    return model(input_ids=ids[None]).logits[0, :-1].float().log_softmax(-1).gather(1, ids[1:, None]).squeeze(1)


def per_sample(values: torch.Tensor, samples: list[Sample], width: int | None) -> list[torch.Tensor]:
    """Each sample's trained positions of a flattened batch: packed one after another, or (`width`) padded rows."""
    out, start = [], 0
    for row, sample in enumerate(samples):
        trained = sample.loss_mask[1:].bool()
        begin = row * width if width else start
        out.append(values[begin : begin + len(sample) - 1][trained])
        start += len(sample)
    return out


def test_every_path_gives_a_plain_forwards_log_probs_loss_and_gradients(arch_folder):
    reference = plain(arch_folder)
    architecture = read_architecture(reference.config)
    samples = groups()
    weights = [torch.linspace(-1, 1, int(s.loss_mask[1:].sum())) for s in samples]
    expected = [reference_log_probs(reference, s.input_ids)[s.loss_mask[1:].bool()] for s in samples]
    (-sum((w * e).sum() for w, e in zip(weights, expected))).backward()
    expected_grads = {name: p.grad for name, p in reference.named_parameters()}
    expected = [e.detach() for e in expected]

    layouts = {"packed": (True, False), "padded": (False, False)}
    if architecture.shares_prompts:
        layouts["shared prompt"] = (True, True)
    for layout, (packed, share) in layouts.items():
        model = as_trained(arch_folder, packed, reference)
        batch = collate_packed(samples, share_prefixes=share) if packed else collate_padded(samples, pad_token_id=0)
        width = None if packed else batch.inputs["input_ids"].shape[1]
        labels = batch.targets["labels"]
        log_probs, _ = token_log_probs(model, batch.inputs, labels, 1.0, chunk_tokens=16, token_rows=batch.token_rows)
        got = per_sample(log_probs, samples, width)
        for sample_log_probs, want in zip(got, expected):
            torch.testing.assert_close(sample_log_probs, want, atol=1e-4, rtol=0, msg=f"{layout}: log-probs")
        (-sum((w * g).sum() for w, g in zip(weights, got))).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-4, rtol=1e-3, msg=f"{layout}: gradient of {name}")
        if share:
            continue
        with torch.no_grad():  # SFT's summed cross-entropy over the same positions (SFT shares no prompt)
            nll = token_nll_sum(model, batch.inputs, labels, chunk_tokens=16)
        torch.testing.assert_close(nll, -sum(e.sum() for e in expected), atol=1e-3, rtol=1e-5, msg=f"{layout}: SFT loss")


def test_the_rollout_samples_from_a_plain_forwards_distribution(arch_folder):
    """The hf engine's prefill (the prompts' common prefix of 10 tokens, longer than the windows, forwarded once
    where the architecture allows), cache copies for n responses, per-row cache selection as rows end (recurrent
    states included) and padding give each sampled token a plain forward's log-prob."""
    reference = plain(arch_folder)
    engine = HFRollout(arch_folder, torch.device("cpu"), torch.float32, pad_id=0)
    first, second = (s.input_ids[: s.shared_prefix].tolist() for s in groups()[::3])
    prompts = [first, first[:10] + second, first[:12]]
    torch.manual_seed(0)
    generations = engine.generate(prompts, n=3, max_new_tokens=14, batch_size=9, calculate_log_probs=True)
    assert len(generations) == 9 and max(len(g.response_ids) for g in generations) > 8  # past the window
    for generation in generations:
        ids = torch.tensor(generation.prompt_ids + generation.response_ids)
        expected = reference_log_probs(reference, ids)[len(generation.prompt_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(generation.log_probs), expected.detach(), atol=1e-4, rtol=0)


def blind_packed_attention(*args, sliding_window=None, s_aux=None, **kwargs):
    """The packed attention as it was before it took windows and sinks."""
    from fsdptrain.models.attention import packed_attention_forward

    return packed_attention_forward(*args, **kwargs)


def test_a_path_that_drops_the_window_or_the_sinks_is_caught(tmp_path):
    """The check above fails on the packed path when its attention ignores a sliding window or the sinks."""
    from fsdptrain.models import attention

    for arch in ("mistral", "gpt_oss"):
        folder = tmp_path / arch
        make_tiny.tiny_model(arch, VOCAB, seed=0).save_pretrained(folder)
        reference = plain(str(folder))
        model = as_trained(str(folder), True, reference)
        sample = groups()[1]
        batch = collate_packed([sample])
        expected = reference_log_probs(reference, sample.input_ids)[sample.loss_mask[1:].bool()]
        transformers.AttentionInterface.register(attention.PACKED_ATTENTION, blind_packed_attention)
        try:
            with torch.no_grad():
                log_probs, _ = token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=16)
        finally:
            transformers.AttentionInterface.register(attention.PACKED_ATTENTION, attention.packed_attention_forward)
        assert (log_probs[:-1][sample.loss_mask[1:].bool()] - expected).abs().max() > 1e-3, arch


# ---- the trainers: check, a GRPO step and an SFT step on 2 processes, exports --------------------------------------
@pytest.fixture(scope="module")
def text_folders(tmp_path_factory, tokenizer) -> dict[str, str]:
    """Each architecture's tiny model with SmolLM2's tokenizer, for the trainers' own data."""
    root = tmp_path_factory.mktemp("architectures")
    return {arch: save_tiny_model(root / arch, arch, tokenizer) for arch in ARCHITECTURES}


def check(trainer: str, args: list[str], capsys) -> tuple[int, str]:
    code = check_main([trainer, "--device", "cpu", "--nproc-per-node", "2", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.slow
def test_check_passes_every_architecture_and_refuses_what_cannot_run(text_folders, rl_data, chat_data, tmp_path, capsys):
    for arch, folder in text_folders.items():
        assert check("grpo", grpo_args(folder, rl_data, str(tmp_path)), capsys)[0] == 0, arch
    for arch in ("qwen3_next", "gpt_oss", "deepseek_v3", "gemma3_text"):  # SFT builds the same model: the attention variants once more
        assert check("sft", sft_args(text_folders[arch], chat_data, str(tmp_path)), capsys)[0] == 0, arch
    code, said = check("sft", sft_args(text_folders["gpt_oss"], chat_data, str(tmp_path), model__use_remove_padding="false",
                                       model__attn_implementation="sdpa"), capsys)
    assert code == 1 and "model.partial_pretrain" in said and "gpt_oss" in said and "scaled_dot_product_attention" in said
    if importlib.util.find_spec("vllm") is not None:  # what vLLM's CPU build cannot run as the trainer computes it
        for arch, why in (("gpt_oss", "computes gpt_oss's token log-probs differently"), ("qwen3_next", "linear attention in bf16 only")):
            code, said = check("grpo", grpo_args(text_folders[arch], rl_data, str(tmp_path), actor_rollout_ref__rollout__name="vllm"), capsys)
            assert code == 1 and why in said and "rollout.name=hf" in said, said


def test_the_plan_fits_each_architecture(text_folders, tokenizer, rl_data, tmp_path):
    """Recurrent layers: no shared prompt (the policy's or a critic's); dropout in the config: the old log-probs by
    their own pass (eval mode); an MoE config asking for its routers' load-balancing loss: that loss, no shared
    prompt."""
    from fsdptrain.check import composed
    from fsdptrain.trainer.grpo import read_grpo_inputs
    from fsdptrain.trainer.grpo_plan import read_grpo_config, resolve_grpo

    world = World(0, 2, 2, torch.device("cpu"), True)
    plans = {}
    folders = {**text_folders, "balanced": save_tiny_model(tmp_path / "balanced", "qwen3_moe", tokenizer, output_router_logits=True)}
    for arch in ("llama", "qwen3_next", "seed_oss", "qwen3_moe", "balanced"):
        problems: list[str] = []
        config = read_grpo_config(composed("grpo_trainer", grpo_args(folders[arch], rl_data, str(tmp_path))), problems, world)
        plans[arch] = read_grpo_inputs(*resolve_grpo(config, world)).plan
    assert plans["llama"].forward.share_prompts and plans["llama"].one_pass
    assert not plans["qwen3_next"].forward.share_prompts and plans["qwen3_next"].one_pass
    assert plans["seed_oss"].forward.share_prompts and not plans["seed_oss"].one_pass
    assert plans["qwen3_moe"].forward.share_prompts and plans["qwen3_moe"].loss.router_balance is None
    assert not plans["balanced"].forward.share_prompts and plans["balanced"].loss.router_balance.coef == 0.001  # Qwen3-MoE's default
    # PPO: a Qwen3-Next critic beside a Llama policy packs each response whole, the policy still shares its prompts
    config = read_grpo_config(composed("grpo_trainer", grpo_args(folders["llama"], rl_data, str(tmp_path), algorithm__adv_estimator="gae",
                                                                 critic__model__path=folders["qwen3_next"])), [], world)
    ppo = read_grpo_inputs(*resolve_grpo(config, world)).plan
    assert ppo.forward.share_prompts and not ppo.critic.forward.share_prompts


@pytest.mark.slow
# the others train through the trainers elsewhere: Llama and Qwen2/3 in the rest of the suite, Qwen3-MoE, gpt-oss and
# Qwen3-Next in the layout tests below, verl's examples (tests/test_verl_keys.py) and the exports
@pytest.mark.parametrize("arch", ["gemma3_text", "qwen2_window", "glm4_moe", "deepseek_v3", "seed_oss", "mistral"])
def test_a_grpo_step_and_an_sft_step_on_two_processes(arch, text_folders, rl_data, chat_data, tmp_path):
    folder = text_folders[arch]
    out = str(tmp_path / "grpo")
    torchrun(2, "fsdptrain.grpo_trainer", grpo_args(folder, rl_data, out, trainer__total_training_steps=1, trainer__test_freq=-1))
    (step,) = read_metrics(out)
    assert step["step"] == 1 and 0 < step["actor/grad_norm"] < float("inf"), step
    out = str(tmp_path / "sft")
    torchrun(2, "fsdptrain.sft_trainer", sft_args(folder, chat_data, out, trainer__total_training_steps=1, trainer__test_freq=-1))
    (step,) = read_metrics(out)
    assert step["step"] == 1 and 0 < step["train/loss"] < float("inf"), step


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3", "gpt_oss"])
def test_an_export_reloads_whole_and_gives_the_trained_models_loss(arch, text_folders, chat_data, tmp_path):
    """hf_model exports every parameter and persistent buffer (an MoE router's score correction bias); the
    export's validation loss, computed by a plain forward over the samples the trainer read, is the one the
    trained model logged."""
    from fsdptrain.check import composed
    from fsdptrain.trainer.sft import read_sft_inputs
    from fsdptrain.trainer.sft_plan import plan_sft, read_sft_config

    out = str(tmp_path / "sft")
    args = sft_args(text_folders[arch], chat_data, out, trainer__total_training_steps=1, trainer__test_freq=1, trainer__save_freq=1,
                    trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]")
    torchrun(2, "fsdptrain.sft_trainer", args)
    logged = [m["val/loss"] for m in read_metrics(out) if "val/loss" in m][-1]
    export = Path(out) / "global_step_1" / "huggingface"
    model, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert any("e_score_correction_bias" in name for name, _ in model.named_buffers()) == (arch != "gpt_oss")
    world = World(0, 2, 2, torch.device("cpu"), True)
    val = read_sft_inputs(plan_sft(read_sft_config(composed("sft_trainer", args), [], world))).val
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for sample in val:
            logits = model.eval()(input_ids=sample.input_ids[None]).logits[0, :-1]
            trained = sample.loss_mask[1:].bool()
            nll += float(F.cross_entropy(logits[trained], sample.input_ids[1:][trained], reduction="sum"))
            tokens += int(trained.sum())
    assert abs(nll / tokens - logged) < 1e-4, (nll / tokens, logged)
    assert json.loads((export / "config.json").read_text())["model_type"] == arch


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_moe_sinks_and_linear_attention_train_the_same_whatever_the_layout(arch, text_folders, tokenizer, chat_data, tmp_path):
    """Three SFT steps of Qwen3-MoE (experts sharded with their layer, the routers' load-balancing loss on), of
    gpt-oss (sinks split with their heads under Ulysses, sliding windows) and of Qwen3-Next (linear-attention layers
    one sequence at a time, the whole row gathered under Ulysses): dp2 and sp2 train as one process does (losses,
    the balancing loss, gradient norms, weights)."""
    folder = text_folders[arch]
    if arch == "qwen3_moe":
        folder = save_tiny_model(tmp_path / "balanced", arch, tokenizer, output_router_logits=True, router_aux_loss_coef=0.5)
    runs = {}
    for name, nproc, sp in (("dp1", 1, 1), ("dp2", 2, 1), ("sp2", 2, 2)):
        runs[name] = str(tmp_path / name)
        run_sft(nproc, folder, chat_data, runs[name], ulysses_sequence_parallel_size=sp, data__micro_batch_size_per_gpu=1 + (name == "dp1"),
                trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]")
    for name in ("dp2", "sp2"):
        # Qwen3-Next under Ulysses: each rank runs the linear-attention layers over the whole row and their weights'
        # gradients are summed from the slices, in another order; AdamW's first steps scale such differences in
        # the smallest gradients (A_log's) up to 2e-5
        assert_same_run(runs[name], runs["dp1"], atol=1e-4 if (arch, name) == ("qwen3_next", "sp2") else 1e-5)
        if arch == "qwen3_moe":
            balancing = [m["train/moe_load_balancing_loss"] for m in read_metrics(runs[name])]
            assert balancing == pytest.approx([m["train/moe_load_balancing_loss"] for m in read_metrics(runs["dp1"])], abs=1e-6)
            assert all(1.9 < value < 4 for value in balancing), balancing  # E * sum_e f_e P_e: top_k (2) when balanced, E at worst


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next"])
def test_each_sequences_load_balancing_loss_is_transformers_own(arch, tmp_path):
    """models/router_balance.py over packed and padded rows: each sequence's loss and its gradient equal
    transformers' aux_loss of a plain forward of that sequence alone."""
    from fsdptrain.models.router_balance import router_balance, sequence_ids, sequence_losses

    make_tiny.tiny_model(arch, VOCAB, seed=0, output_router_logits=True, router_aux_loss_coef=0.01).save_pretrained(tmp_path)
    reference = plain(str(tmp_path))
    balance = router_balance(reference.config)
    assert balance is not None and balance.coef == 0.01
    samples = groups()
    expected = [reference(input_ids=s.input_ids[None], output_router_logits=True).aux_loss for s in samples]
    sum(expected).backward()
    expected_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    for packed in (True, False):
        model = as_trained(str(tmp_path), packed, reference)
        batch = collate_packed(samples) if packed else collate_padded(samples, pad_token_id=0)
        router = []
        token_log_probs(model, batch.inputs, batch.targets["labels"], 1.0, chunk_tokens=16, router=router)
        losses = sequence_losses(router, sequence_ids(batch.inputs, len(samples)), len(samples), balance)
        torch.testing.assert_close(losses, torch.stack(expected).detach(), atol=1e-6, rtol=1e-5)
        losses.sum().backward()
        for name, param in model.named_parameters():
            if name in expected_grads:
                torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_a_grpo_mini_batch_with_the_balancing_loss_has_the_same_gradient_whatever_the_layout(tmp_path):
    """The policy loss plus Qwen3-MoE's load-balancing loss: one mini-batch's gradient on one process (packed rows),
    two (padded rows, one sequence a micro-batch) and a Ulysses group of two, as test_grpo's layout test."""
    from tests.checks.common import relative_gap

    folder = tmp_path / "model"
    make_tiny.tiny_model("qwen3_moe", 1024, seed=0, output_router_logits=True, router_aux_loss_coef=0.5).save_pretrained(folder)
    gradients = {}
    for name, (nproc, micro, packed, sp) in {"dp1": (1, 8, "true", 1), "dp2-padded": (2, 1, "false", 1), "sp2": (2, 3, "true", 2)}.items():
        out = str(tmp_path / f"{name}.pt")
        torchrun(nproc, "tests.checks.grpo_check", [str(folder), out, str(micro), packed, str(sp), "balance"])
        (gradients[name],) = torch.load(out).values()
    for name in ("dp2-padded", "sp2"):
        assert relative_gap(gradients[name], gradients["dp1"]) < 5e-6, name
