"""Run under torchrun by test_loss.py: per-token log-probs and entropy through the chunked path under Ulysses
sequence parallelism (every rank an SP rank, each holding a slice of the packed row), against full logits of the
whole row on one rank, written without the project's loss code. Values, and every parameter's gradient for a
different upstream gradient at each token (tied output layer: the tiny Llama ties it).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checks.logprob_sp_check MODEL_DIR
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from fsdptrain.data.dataset import Sample
from fsdptrain.data.micro_batches import collate, collate_packed
from fsdptrain.distributed.mesh import init_parallel
from fsdptrain.distributed.ulysses import gather_sequence
from fsdptrain.models.attention import PACKED_ATTENTION
from fsdptrain.models.loss import IGNORE_INDEX, token_log_probs


def main() -> None:
    TEMPERATURE = 0.9
    parallel = init_parallel("cpu", sp_size=int(os.environ["WORLD_SIZE"]))  # every rank in one SP group
    models = [AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation=PACKED_ATTENTION, dtype=torch.float32) for _ in range(2)]
    assert models[0].get_input_embeddings().weight is models[0].get_output_embeddings().weight, "the check wants a tied output layer"
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (13, 26, 8):  # odd and even lengths: the split between ranks falls inside a sample
        mask = torch.zeros(n, dtype=torch.long)
        mask[n // 3 :] = 1
        samples.append(Sample(torch.randint(3, 1000, (n,), generator=g), mask))
    whole = collate_packed(samples, pad_to_multiple=parallel.sp_size)
    upstream = torch.randn(whole.targets["labels"].numel(), generator=g)

    # The reference: the whole row on this rank, full logits, log-softmax and the entropy's definition.
    labels = whole.targets["labels"][0]
    kept = labels != IGNORE_INDEX
    log_softmax = (models[0](**whole.inputs).logits[0].float() / TEMPERATURE).log_softmax(dim=1)
    expected = torch.zeros(len(labels)).masked_scatter(kept, log_softmax[kept].gather(1, labels[kept, None]).squeeze(1))
    expected_entropy = torch.zeros(len(labels)).masked_scatter(kept, -(log_softmax.exp() * log_softmax).sum(1)[kept])
    ((expected + expected_entropy) * upstream).sum().backward()

    # This rank's slice, through the chunked path and the all-to-alls.
    batch = collate(samples, packed=True, pad_token_id=0, parallel=parallel)
    log_probs, entropy = token_log_probs(models[1], batch.inputs, batch.targets["labels"], TEMPERATURE, chunk_tokens=5,
                                         with_entropy=True, sp_group=parallel.ulysses_group)
    width = len(log_probs)
    mine = slice(parallel.sp_rank * width, (parallel.sp_rank + 1) * width)
    ((log_probs + entropy) * upstream[mine]).sum().backward()
    for got, want in ((log_probs, expected), (entropy, expected_entropy)):
        torch.testing.assert_close(gather_sequence(got.detach()[None], parallel.ulysses_group)[0], want.detach(), rtol=1e-6, atol=1e-6)
    for (name, reference), (_, sharded) in zip(models[0].named_parameters(), models[1].named_parameters()):
        grad = sharded.grad.clone()
        dist.all_reduce(grad, group=parallel.ulysses_group)  # each rank holds its slice's share of the gradient
        scale = max(1.0, float(reference.grad.abs().max()))
        torch.testing.assert_close(grad, reference.grad, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    dist.destroy_process_group()
    print("ok", parallel.rank)


if __name__ == "__main__":
    main()
