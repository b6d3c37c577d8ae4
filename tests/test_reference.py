"""The trainer against a loop written without the project's code: a plain Hugging Face model, the chat template,
F.cross_entropy over the assistant tokens, torch.optim.AdamW and a clip on the fp64 gradient norm. A bug shared by
both sides of a layout comparison (a constant factor in the gradient, a mask off by one) cannot cancel here."""

import os

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_same_weights, hf_weights, read_metrics, run_sft

pytestmark = pytest.mark.slow

STEPS, BATCH, MICRO, LR, BETAS, WEIGHT_DECAY, CLIP = 3, 8, 2, 1e-3, (0.9, 0.95), 0.01, 1.0
SEED = 1  # trainer.seed, which initializes a LoRA run's adapters
RUN = dict(
    data__shuffle="false", data__train_batch_size=BATCH, data__micro_batch_size_per_gpu=MICRO, optim__lr=LR,
    optim__betas=f"[{BETAS[0]},{BETAS[1]}]", optim__weight_decay=WEIGHT_DECAY, optim__clip_grad=CLIP,
    optim__lr_scheduler="constant", trainer__total_training_steps=STEPS,
    trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]",
)


def assistant_tokens(tokenizer, messages) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the templated chat, and a mask over what the assistant writes: SmolLM2's ChatML turns open with
    `<|im_start|>assistant\\n`; the mask runs from there through the turn's closing `<|im_end|>`."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer.encode("assistant\n", add_special_tokens=False)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    i = 0
    while i < len(ids):
        if ids[i] == start and ids[i + 1 : i + 1 + len(header)] == header:
            j = i + 1 + len(header)
            while ids[j] != end:
                mask[j] = True
                j += 1
            mask[j] = True
            i = j
        i += 1
    return torch.tensor(ids), mask


def reference_run(model_dir: str, train_file: str, balance_tokens: bool, lora: LoraConfig | None = None) -> tuple[list[float], list[float], nn.Module]:
    """Losses, gradient norms and the trained model of STEPS steps over consecutive batches of the file's rows.

    balance_tokens: every assistant token of a step weighs the same (sum / the step's token count); otherwise
    verl's mean over micro-batches of each micro-batch's token mean. With `lora`: peft's model, its adapters
    initialized after torch.manual_seed(trainer.seed), and only they trained."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if lora is not None:
        torch.manual_seed(SEED)
        model = get_peft_model(model, lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    rows = pq.read_table(train_file).column("messages").to_pylist()
    losses, norms = [], []
    for step in range(STEPS):
        chats = [assistant_tokens(tokenizer, m) for m in rows[step * BATCH : (step + 1) * BATCH]]
        step_tokens = sum(int(mask[1:].sum()) for _, mask in chats)
        nll_total = 0.0
        for first in range(0, BATCH, MICRO):
            micro = chats[first : first + MICRO]
            micro_tokens = sum(int(mask[1:].sum()) for _, mask in micro)
            for ids, mask in micro:
                logits = model(ids[None]).logits[0, :-1]
                nll = F.cross_entropy(logits, ids[1:], reduction="none")[mask[1:]].sum()
                scale = 1 / step_tokens if balance_tokens else 1 / (micro_tokens * (BATCH // MICRO))
                (nll * scale).backward()
                nll_total += float(nll)
        # summed in fp64 as the trainer does: torch's fp32 norm kernel on CPU is off by ~5e-5 of itself on the
        # embedding's gradient (mostly zero rows), where a plain sum of squares agrees to ~1e-7
        norm = torch.stack([p.grad.double().pow(2).sum() for p in trained]).sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(trained, CLIP, norm)
        norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(nll_total / step_tokens)  # the logged loss is the step's token mean in both modes
    return losses, norms, model


@pytest.mark.parametrize(
    "balance, chunk", [("true", 1024), ("true", 16), ("true", 0), ("false", 1024)],
    ids=["balanced-one-chunk", "balanced-several-chunks", "balanced-full-logits", "verl-micro-batch-means"],
)
def test_one_process_equals_a_plain_torch_loop(tmp_path, tiny_llama, chat_data, balance, chunk):
    out = str(tmp_path)
    run_sft(1, tiny_llama, chat_data, out, data__balance_dp_token=balance, model__chunked_loss_tokens=chunk, **RUN)
    losses, norms, model = reference_run(tiny_llama, chat_data["train"], balance_tokens=balance == "true")
    weights = model.state_dict()
    metrics = read_metrics(out)
    assert [m["train/loss"] for m in metrics] == pytest.approx(losses, rel=1e-6)
    assert [m["train/grad_norm"] for m in metrics] == pytest.approx(norms, rel=1e-5)
    trained = hf_weights(os.path.join(out, f"global_step_{STEPS}"))
    # Adam divides each gradient by its own running scale, so an element whose gradient is near zero carries the
    # float noise of the two computations into its update: 5% of one step's size (lr) bounds that.
    assert_same_weights(trained, {k: v for k, v in weights.items() if k in trained}, atol=0.05 * LR)


def test_lora_on_two_processes_equals_peft_on_one(tmp_path, tiny_llama, chat_data):
    """LoRA SFT on 2 processes against peft's model trained by the plain loop on one: the same losses, gradient
    norms and adapters (the peft-format export), and a merged export that is peft's merged model."""
    out = str(tmp_path)
    run_sft(2, tiny_llama, chat_data, out, data__balance_dp_token="true", model__lora_rank=4, model__lora_alpha=8,
            **{**RUN, "trainer__checkpoint__save_contents": "[model,optimizer,extra,hf_model,lora_adapter]"})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    losses, norms, model = reference_run(tiny_llama, chat_data["train"], balance_tokens=True, lora=lora)
    metrics = read_metrics(out)
    assert [m["train/loss"] for m in metrics] == pytest.approx(losses, rel=1e-6)
    assert [m["train/grad_norm"] for m in metrics] == pytest.approx(norms, rel=1e-5)
    step_dir = os.path.join(out, f"global_step_{STEPS}")
    adapters = load_file(os.path.join(step_dir, "lora_adapter", "adapter_model.safetensors"))
    expected = get_peft_model_state_dict(model)
    assert len(adapters) == 2 * 7 * 2  # A and B on the 7 linear layers of each of the 2 layers
    assert_same_weights(adapters, expected, atol=0.05 * LR)  # Adam's float noise, as above
    assert any(float(t.abs().max()) > LR for k, t in adapters.items() if "lora_B" in k), "lora_B never left zero"
    merged = model.merge_and_unload().state_dict()
    exported = hf_weights(step_dir)
    assert_same_weights(exported, {k: v for k, v in merged.items() if k in exported}, atol=1e-6)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), os.path.join(step_dir, "lora_adapter"))
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_bf16_weights_and_compute_train_on_cpu(tmp_path, tiny_llama, chat_data):
    """The SFT example (README, docs/sft.md) trains in bf16 (model_dtype and param_dtype); on CPU it runs, its loss
    falls, and the export is bf16."""
    out = str(tmp_path)
    run_sft(2, tiny_llama, chat_data, out, model__fsdp_config__model_dtype="bf16",
            model__fsdp_config__mixed_precision__param_dtype="bf16", trainer__total_training_steps=6,
            trainer__checkpoint__save_contents="[model,optimizer,extra,hf_model]")
    losses = [m["train/loss"] for m in read_metrics(out)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1
    with safe_open(os.path.join(out, "global_step_6", "huggingface", "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
