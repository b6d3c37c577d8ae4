"""The chunked losses (summed cross-entropy, per-token log-probs and entropy): the values and gradients of full
logits, without holding them."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import collate_packed
from fsdptrain.models.attention import PACKED_ATTENTION
from fsdptrain.models.loading import tied_embedding_grad_in_place
from fsdptrain.models.loss import IGNORE_INDEX, chunked_cross_entropy_sum, chunked_token_log_probs, token_log_probs, token_nll_sum

from conftest import torchrun


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
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(3, 1000, (n,), generator=g), _mask(n, kind)) for n in (13, 40)]
    batch = collate_packed(samples)
    losses = [token_nll_sum(m, batch.inputs, batch.targets["labels"], chunk) for m, chunk in zip(models, (0, 10))]
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
        for _ in range(2):
            token_nll_sum(model, batch.inputs, batch.targets["labels"], chunk_tokens=10).backward()
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert models[1].get_input_embeddings().weight.grad[padding_id].abs().sum() > 0  # the output layer's part
    with torch.no_grad():
        assert not models[1].get_input_embeddings()(batch.inputs["input_ids"]).requires_grad


def test_untied_embedding_is_left_alone(tiny_qwen2):
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    assert not tied_embedding_grad_in_place(model)
    assert "forward" not in vars(model.get_input_embeddings())


def _direct_log_probs(hidden, weight, targets, temperature):
    """The reference: full logits, torch's log-softmax, and the entropy from its definition."""
    log_softmax = ((hidden @ weight.T).float() / temperature).log_softmax(dim=1)
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=1)
    return log_softmax.gather(1, targets[:, None]).squeeze(1), entropy


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (7, 0.7), (64, 1.3), (1000, 1.0)])
def test_chunked_log_probs_and_entropy_equal_full_logits(chunk, temperature):
    """Values, and gradients for a different upstream gradient at every token (as a policy loss gives them)."""
    torch.manual_seed(0)
    hidden = torch.randn(100, 32, requires_grad=True)
    weight = (torch.randn(500, 32) * 0.2).requires_grad_()  # logits of a trained model's scale (a few units)
    targets = torch.randint(0, 500, (100,))
    upstream_lp, upstream_ent = torch.randn(100), torch.randn(100)
    direct = _direct_log_probs(hidden, weight, targets, temperature)
    direct_grads = torch.autograd.grad((direct[0] * upstream_lp).sum() + (direct[1] * upstream_ent).sum(), (hidden, weight), retain_graph=True)
    chunked = chunked_token_log_probs(hidden, weight, targets, temperature, chunk, "entropy")
    chunked_grads = torch.autograd.grad((chunked[0] * upstream_lp).sum() + (chunked[1] * upstream_ent).sum(), (hidden, weight))
    for a, b in zip(chunked, direct):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(chunked_grads, direct_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))
    log_probs, entropy = chunked_token_log_probs(hidden, weight, targets, temperature, chunk, None)
    assert entropy is None
    lp_grads = torch.autograd.grad((log_probs * upstream_lp).sum(), (hidden, weight))
    direct_lp_grads = torch.autograd.grad((direct[0] * upstream_lp).sum(), (hidden, weight))
    for a, b in zip(lp_grads, direct_lp_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))
    # one output in the loss, the other kept as a metric (its backward skipped): the same gradients
    log_probs, entropy = chunked_token_log_probs(hidden, weight, targets, temperature, chunk, "entropy")
    for a, b in zip(torch.autograd.grad((log_probs * upstream_lp).sum(), (hidden, weight), retain_graph=True), direct_lp_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))
    direct_ent_grads = torch.autograd.grad((_direct_log_probs(hidden, weight, targets, temperature)[1] * upstream_ent).sum(), (hidden, weight))
    for a, b in zip(torch.autograd.grad((entropy * upstream_ent).sum(), (hidden, weight)), direct_ent_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (7, 0.7), (1000, 1.3)])
def test_chunked_sum_of_squared_probabilities_equals_full_logits(chunk, temperature):
    """The optimal token baseline's statistic, sum_v softmax(z / temperature)_v^2, chunked as the log-probs."""
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(50, 32), torch.randn(300, 32) * 0.3, torch.randint(0, 300, (50,))
    log_probs, sum_pi_squared = chunked_token_log_probs(hidden, weight, targets, temperature, chunk, "sum_pi_squared")
    probs = torch.softmax((hidden @ weight.T) / temperature, dim=1)
    torch.testing.assert_close(sum_pi_squared, probs.square().sum(dim=1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_probs, _direct_log_probs(hidden, weight, targets, temperature)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_model_log_probs_and_gradients_match_full_logits(tiny_qwen2, tied):
    """Through the model, with a tied (or untied) output layer: every parameter's gradient agrees."""
    config = AutoConfig.from_pretrained(tiny_qwen2)
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    chunked = AutoModelForCausalLM.from_config(config, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    chunked.load_state_dict(reference.state_dict())
    g = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(3, 1000, (n,), generator=g), _mask(n, "assistant")) for n in (13, 40)]
    batch = collate_packed(samples)
    labels = batch.targets["labels"]
    upstream = torch.randn(labels.numel(), generator=g)
    # The reference is written without the project's loss code: logits, log-softmax, gather.
    logits = reference(**batch.inputs).logits[0].float() / 0.8
    log_softmax = logits.log_softmax(dim=1)
    kept = labels[0] != IGNORE_INDEX
    expected = torch.zeros(labels.numel()).masked_scatter(kept, log_softmax[kept].gather(1, labels[0, kept, None]).squeeze(1))
    expected_entropy = torch.zeros(labels.numel()).masked_scatter(kept, -(log_softmax.exp() * log_softmax).sum(1)[kept])
    ((expected + expected_entropy) * upstream).sum().backward()
    log_probs, entropy = token_log_probs(chunked, batch.inputs, labels, 0.8, chunk_tokens=7, with_entropy=True)
    ((log_probs + entropy) * upstream).sum().backward()
    torch.testing.assert_close(log_probs, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-6, atol=1e-6)
    for (name, a), (_, b) in zip(reference.named_parameters(), chunked.named_parameters()):
        # The kernel's own gradients agree to 1e-6 (above); through the backbone, fp32 sums in another order
        # grow with the gradient's scale, as in the cross-entropy test.
        scale = max(1.0, float(a.grad.abs().max()))
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    full_path = token_log_probs(chunked, batch.inputs, labels, 0.8, chunk_tokens=0)[0]  # the full-logits path
    torch.testing.assert_close(full_path.detach(), expected.detach(), rtol=1e-6, atol=1e-6)


def test_log_probs_under_sequence_parallelism_equal_the_whole_row(ids_llama):
    result = torchrun(2, "tests.checks.logprob_sp_check", [ids_llama])
    assert result.stdout.count("ok") == 2
