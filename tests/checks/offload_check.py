"""Run under torchrun on a GPU by test_cuda.py: verl's offload between phases (distributed/offload.py). A sharded
model trained three steps twice, the second time with its parameters and optimizer state sent to host memory and
back before each step's passes: the device memory each departure frees is the parameter shards' and (from the
second step, once AdamW has state) the two moments' too, and the losses and final weights are those of the run
without offload, bit for bit.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checks.offload_check MODEL_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from fsdptrain.distributed.offload import PhaseOffload


def train(model_dir: str, offload: bool, device: torch.device) -> tuple[list[float], list[int], int, dict[str, torch.Tensor]]:
    """Three steps; returns the losses, the bytes each departure freed, the parameter shards' bytes and the final
    weights (this rank's shards)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    phases = PhaseOffload(model, optimizer, offload, offload, device)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    ids = torch.arange(64, device=device).reshape(2, 32) % 97 + dist.get_rank()
    losses, freed = [], []
    for _ in range(3):
        before = torch.cuda.memory_allocated(device)
        phases.leave()  # as while the rollouts are generated
        freed.append(before - torch.cuda.memory_allocated(device))
        phases.params_back()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        phases.optimizer_back()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, freed, shard_bytes, {name: p.to_local().detach().cpu() for name, p in model.named_parameters()}


def main() -> None:
    dist.init_process_group("nccl")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    plain_losses, plain_freed, _, plain_weights = train(sys.argv[1], False, device)
    losses, freed, shard_bytes, weights = train(sys.argv[1], True, device)
    assert plain_freed == [0, 0, 0], plain_freed
    assert freed[0] >= 0.95 * shard_bytes, (freed, shard_bytes)  # no optimizer state before the first step
    assert all(f >= 0.95 * 3 * shard_bytes for f in freed[1:]), (freed, shard_bytes)  # and AdamW's two moments after it
    assert losses == plain_losses, (losses, plain_losses)
    assert all(torch.equal(weights[name], plain_weights[name]) for name in weights)
    if dist.get_rank() == 0:
        print(f"offload check passed: {[f / 2**20 for f in freed]} MiB freed a departure, losses {losses}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
