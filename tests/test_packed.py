"""Packed rows (no padding, attention kept inside each sequence) give the padded computation's logits and loss."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import collate_packed, collate_padded
from fsdptrain.models.attention import PACKED_ATTENTION, attend_packed, cu_seqlens_from_position_ids
from fsdptrain.models.loss import token_log_probs, token_nll_sum


def samples(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) < 0.6).long()
        out.append(Sample(torch.randint(3, vocab, (n,), generator=g), mask))
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def family_model(request, tmp_path_factory, tiny_llama, tiny_qwen2):
    """A tiny model of each family the trainer supports, saved as a folder (Qwen3 adds q/k norms)."""
    if request.param == "llama":
        return tiny_llama
    if request.param == "qwen2":
        return tiny_qwen2
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[request.param]
    torch.manual_seed(0)
    config = config_class(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    path = tmp_path_factory.mktemp(request.param)
    model_class(config).save_pretrained(path)
    return str(path)


def test_packed_equals_padded(family_model):
    path = family_model
    packed_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    padded_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    batch_samples = samples([7, 31, 1, 18, 64], min(packed_model.config.vocab_size, 1000))
    packed, padded = collate_packed(batch_samples), collate_padded(batch_samples, pad_token_id=0)
    with torch.no_grad():
        packed_logits = packed_model(**packed.inputs).logits[0]
        padded_logits = padded_model(**padded.inputs).logits
    start = 0
    for row, sample in enumerate(batch_samples):
        n = len(sample)
        torch.testing.assert_close(packed_logits[start : start + n], padded_logits[row, :n], atol=1e-5, rtol=1e-5)
        start += n
    with torch.no_grad():  # the chunked loss on one side, full logits on the other
        torch.testing.assert_close(
            token_nll_sum(packed_model, packed.inputs, packed.targets["labels"], chunk_tokens=16),
            token_nll_sum(padded_model, padded.inputs, padded.targets["labels"], chunk_tokens=0),
            atol=1e-5, rtol=1e-5,
        )


def rl_groups(vocab: int) -> list[Sample]:
    """Two prompts with their responses, and between them a sample whose first 5 tokens are no shared prompt;
    the loss mask covers each response, and each sample says how long its prompt is."""
    g = torch.Generator().manual_seed(1)
    out = []
    for prompt_length, response_lengths in ((9, (4, 7, 1)), (12, (0,)), (6, (3, 5))):
        prompt = torch.randint(3, vocab, (prompt_length,), generator=g)
        for n in response_lengths:
            ids = torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)])
            shared = 5 if n == 0 else prompt_length
            out.append(Sample(ids, (torch.arange(len(ids)) >= shared).long(), {"advantage": torch.randn(len(ids), generator=g)}, shared))
    return out


@pytest.mark.parametrize("chunk_tokens", [5, 0])
def test_shared_prompts_give_each_sequence_its_own_log_probs_and_gradients(family_model, chunk_tokens):
    """A row that holds each group's prompt once gives every response the log-probs, entropies and parameter
    gradients that transformers computes for each prompt + response on its own (sdpa, one sequence at a time)."""
    temperature = 0.7
    model = AutoModelForCausalLM.from_pretrained(family_model, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(family_model, attn_implementation="sdpa", dtype=torch.float32)
    group_samples = rl_groups(min(model.config.vocab_size, 1000))
    batch = collate_packed(group_samples, share_prefixes=True)
    assert batch.inputs["input_ids"].shape[1] == sum(len(s) for s in group_samples) - 2 * 9 - 6  # each prompt once
    labels = batch.targets["labels"]
    log_probs, entropy = token_log_probs(model, batch.inputs, labels, temperature, chunk_tokens, with_entropy=True, token_rows=batch.token_rows)
    (-(log_probs * batch.targets["advantage"].flatten()).sum() + 0.1 * entropy.sum()).backward()

    expected_loss, start = 0.0, 0
    for sample in group_samples:
        log_softmax = (reference(input_ids=sample.input_ids[None]).logits[0, :-1] / temperature).log_softmax(-1)
        targets = sample.loss_mask[1:].bool()
        expected = log_softmax.gather(1, sample.input_ids[1:, None]).squeeze(1)[targets]
        expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)[targets]
        positions = torch.arange(start, start + len(sample) - 1)[targets]
        torch.testing.assert_close(log_probs[positions], expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[positions], expected_entropy, atol=2e-5, rtol=1e-5)
        expected_loss = expected_loss - (expected * sample.token_values["advantage"][1:][targets]).sum() + 0.1 * expected_entropy.sum()
        start += len(sample)
    assert int((labels != -100).sum()) == sum(int(s.loss_mask[1:].sum()) for s in group_samples)
    expected_loss.backward()
    reference_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference_grads[name].grad, atol=2e-5, rtol=1e-4, msg=name)


def test_sequences_do_not_see_each_other(tiny_llama):
    """Changing one packed sequence leaves the logits of its neighbours unchanged."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    a, b = samples([12, 9], model.config.vocab_size)
    b_changed = Sample(b.input_ids.flip(0), b.loss_mask)
    with torch.no_grad():
        first = model(**collate_packed([b, a]).inputs).logits[0, 9:]
        second = model(**collate_packed([b_changed, a]).inputs).logits[0, 9:]
    torch.testing.assert_close(first, second, atol=1e-6, rtol=0)


def test_host_sequence_boundaries_reach_the_attention(tiny_llama):
    """Boundaries given as transformers' cu_seq_lens_q / max_length_q (as the trainer passes them) keep the
    sequences apart by themselves: with position_ids that do not restart, the logits still equal packing's."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=PACKED_ATTENTION, dtype=torch.float32)
    batch = collate_packed(samples([12, 9, 30], model.config.vocab_size)).inputs
    cu_seqlens = cu_seqlens_from_position_ids(batch["position_ids"])
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        given = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cu_seq_lens_q=cu_seqlens, max_length_q=30).logits
        # Continuous positions change the rotary embedding of later sequences, so compare the first alone there.
        unrestarted = model(input_ids=batch["input_ids"], position_ids=torch.arange(51)[None], cu_seq_lens_q=cu_seqlens,
                            max_length_q=30).logits
        whole_row = model(input_ids=batch["input_ids"], position_ids=torch.arange(51)[None]).logits
    torch.testing.assert_close(given, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(unrestarted[0, :12], expected[0, :12], atol=1e-6, rtol=0)
    assert not torch.allclose(unrestarted[0, 12:], whole_row[0, 12:], atol=1e-3)  # boundaries, not one long sequence


def test_fallback_attention_equals_masked_reference():
    """The CPU path of the varlen attention equals one SDPA call with a block-diagonal causal mask (GQA 8:2)."""
    torch.manual_seed(0)
    lengths = [5, 1, 11, 7]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    total = sum(lengths)
    q, k, v = torch.randn(total, 8, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    out = attend_packed(q, k, v, cu_seqlens_from_position_ids(position_ids), scaling=0.25)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (segment[:, None] == segment[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(4, 1).transpose(0, 1), v.repeat_interleave(4, 1).transpose(0, 1),
        attn_mask=mask, scale=0.25,
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_labels_and_token_values_move_to_the_position_that_predicts_their_token():
    s = Sample(torch.tensor([10, 11, 12, 13]), torch.tensor([0, 0, 1, 1]), {"advantage": torch.tensor([0.0, 0.0, 0.5, 0.75])})
    batch = collate_packed([s, s], pad_to_multiple=3)
    assert batch.targets["labels"].tolist() == [[-100, 12, 13, -100, -100, 12, 13, -100, -100]]
    assert batch.targets["advantage"].tolist() == [[0.0, 0.5, 0.75, 0.0, 0.0, 0.5, 0.75, 0.0, 0.0]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]
    assert set(batch.inputs) == {"input_ids", "position_ids", "cu_seq_lens_q", "max_length_q"}  # loss inputs never reach the model
    assert batch.inputs["cu_seq_lens_q"].tolist() == [0, 4, 8, 9] and batch.token_rows is None
    padded = collate_padded([s, Sample(s.input_ids[:2], s.loss_mask[:2], {"advantage": s.token_values["advantage"][:2]})], 0)
    assert padded.targets["labels"].tolist() == [[-100, 12, 13, -100], [-100, -100, -100, -100]]
    assert padded.targets["advantage"].tolist() == [[0.0, 0.5, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0]]
