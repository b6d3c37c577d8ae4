"""The trainer against a loop written without the project's code: a plain Hugging Face model, the chat template,
F.cross_entropy over the assistant tokens, torch.optim.AdamW and clip_grad_norm_. A bug shared by both sides of
a layout comparison (a constant factor in the gradient, a mask off by one) cannot cancel here."""

import os

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_same_weights, hf_weights, read_metrics, run_sft

pytestmark = pytest.mark.slow

STEPS, BATCH, MICRO, LR, BETAS, WEIGHT_DECAY, CLIP = 3, 8, 2, 1e-3, (0.9, 0.95), 0.01, 1.0
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


def reference_run(model_dir: str, train_file: str, balance_tokens: bool) -> tuple[list[float], list[float], dict]:
    """Losses, gradient norms and final weights of STEPS steps over consecutive batches of the file's rows.

    balance_tokens: every assistant token of a step weighs the same (sum / the step's token count); otherwise
    verl's mean over micro-batches of each micro-batch's token mean."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
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
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(nll_total / step_tokens)  # the logged loss is the step's token mean in both modes
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "balance, chunk", [("true", 1024), ("true", 16), ("true", 0), ("false", 1024)],
    ids=["balanced-one-chunk", "balanced-several-chunks", "balanced-full-logits", "verl-micro-batch-means"],
)
def test_one_process_equals_a_plain_torch_loop(tmp_path, tiny_llama, chat_data, balance, chunk):
    out = str(tmp_path)
    run_sft(1, tiny_llama, chat_data, out, data__balance_dp_token=balance, model__chunked_loss_tokens=chunk, **RUN)
    losses, norms, weights = reference_run(tiny_llama, chat_data["train"], balance_tokens=balance == "true")
    metrics = read_metrics(out)
    assert [m["train/loss"] for m in metrics] == pytest.approx(losses, rel=1e-6)
    assert [m["train/grad_norm"] for m in metrics] == pytest.approx(norms, rel=1e-5)
    trained = hf_weights(os.path.join(out, f"global_step_{STEPS}"))
    # Adam divides each gradient by its own running scale, so an element whose gradient is near zero carries the
    # float noise of the two computations into its update: 5% of one step's size (lr) bounds that.
    assert_same_weights(trained, {k: v for k, v in weights.items() if k in trained}, atol=0.05 * LR)


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
