"""The chunked linear cross-entropy: the loss and gradients of full logits, without holding them."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from fsdptrain.data.batching import IGNORE_INDEX, collate_packed
from fsdptrain.data.dataset import Sample
from fsdptrain.models.attention import PACKED_ATTENTION
from fsdptrain.models.loading import tied_embedding_grad_in_place
from fsdptrain.models.loss import add_nll_forward, chunked_cross_entropy_sum, token_nll_sum


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_equals_full_logits(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(100, 32, requires_grad=True)
    weight = torch.randn(500, 32, requires_grad=True)
    labels = torch.randint(0, 500, (100,))
    labels[::3] = IGNORE_INDEX
    full = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    full_grads = torch.autograd.grad(full, (hidden, weight))
    chunked = chunked_cross_entropy_sum(hidden, weight, labels, chunk)
    chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    torch.testing.assert_close(chunked, full, atol=1e-3, rtol=1e-6)
    for a, b in zip(chunked_grads, full_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the loss alone, no gradients computed
        torch.testing.assert_close(chunked_cross_entropy_sum(hidden, weight, labels, chunk), full, atol=1e-3, rtol=1e-6)


def test_chunked_gradient_of_one_input_only():
    """A frozen output layer (or frozen backbone) gets no gradient, the other one the full-logits gradient."""
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(50, 16), torch.randn(300, 16), torch.randint(0, 300, (50,))
    for trained in (hidden, weight):
        trained.requires_grad_()
        full_grad = torch.autograd.grad(F.cross_entropy(hidden @ weight.T, labels, reduction="sum"), trained)[0]
        chunked_grad = torch.autograd.grad(chunked_cross_entropy_sum(hidden, weight, labels, 16), trained)[0]
        torch.testing.assert_close(chunked_grad, full_grad, atol=1e-5, rtol=1e-5)
        trained.requires_grad_(False)


def _mask(n: int, kind: str) -> torch.Tensor:
    mask = torch.ones(n, dtype=torch.long)
    if kind == "assistant":  # a prompt, then an answer: only positions with a target reach the output layer
        mask[: n // 2] = 0
    elif kind == "none":  # no target at all: the loss is 0 and the backward still runs
        mask[:] = 0
    return mask


@pytest.mark.parametrize("kind", ["all", "assistant", "none"])
def test_model_loss_and_parameter_gradients_match(tiny_qwen2, kind):
    models = [AutoModelForCausalLM.from_pretrained(tiny_qwen2, attn_implementation=PACKED_ATTENTION, dtype=torch.float32) for _ in range(2)]
    add_nll_forward(models[0], chunk_tokens=0)
    add_nll_forward(models[1], chunk_tokens=10)
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(3, 1000, (n,), generator=g), _mask(n, kind)) for n in (13, 40)]
    batch = collate_packed(samples)
    losses = [token_nll_sum(m, batch) for m in models]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-6)
    assert (float(losses[0]) == 0.0) == (kind == "none")
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        # fp32 sums in another order: the error scales with the gradient (the tied embedding's reaches about 5).
        scale = max(1.0, float(a.grad.abs().max()))
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_tied_embedding_adds_its_rows_in_place_equal_to_autograd(tiny_qwen2):
    """The rows added in place give autograd's gradient: over two backwards (accumulated), with the padding id
    (whose row gets no gradient) in the batch; under no_grad the lookup is a plain one."""
    models = [AutoModelForCausalLM.from_pretrained(tiny_qwen2, attn_implementation=PACKED_ATTENTION, dtype=torch.float32) for _ in range(2)]
    tied_embedding_grad_in_place(models[1])
    padding_id = models[0].get_input_embeddings().padding_idx
    assert padding_id is not None
    g = torch.Generator().manual_seed(2)
    samples = []
    for n in (13, 40):
        tokens = torch.randint(3, 1000, (n,), generator=g)
        tokens[::4] = padding_id
        samples.append(Sample(tokens, _mask(n, "assistant")))
    batch = collate_packed(samples)
    for model in models:
        add_nll_forward(model, chunk_tokens=10)
        for _ in range(2):
            token_nll_sum(model, batch).backward()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert models[1].get_input_embeddings().weight.grad[padding_id].abs().sum() > 0  # the output layer's part
    with torch.no_grad():
        assert not models[1].get_input_embeddings()(batch["input_ids"]).requires_grad


def test_untied_embedding_is_left_alone(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    tied_embedding_grad_in_place(model)
    assert "forward" not in vars(model.get_input_embeddings())
