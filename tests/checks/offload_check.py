"""Run under torchrun by test_cuda.py on a GPU and by test_ppo.py on CPU: verl's offload between phases
(distributed/offload.py). A sharded model trained three steps twice, the second time with its parameters and
optimizer state parked in host buffers and back before each step's passes: the memory each departure frees is the
parameter shards' and (from the second step, once AdamW has state) the two moments' too (on a GPU the allocator's
count, on CPU the storages' bytes), and the losses and final weights are those of the run without offload, bit for
bit.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.checks.offload_check MODEL_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from fsdptrain.distributed.offload import HostCopies, local_tensor, optimizer_tensors, parameters_and_gradients


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return sum(local_tensor(t).untyped_storage().nbytes() for t in parameters_and_gradients(model) + optimizer_tensors(optimizer))


def train(model_dir: str, offload: bool, device: torch.device) -> tuple[list[float], list[int], int, dict[str, torch.Tensor]]:
    """Three steps; returns the losses, the bytes each departure freed, the parameter shards' bytes and the final
    weights (this rank's shards)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parked_params, parked_moments = HostCopies(), HostCopies()
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    ids = torch.arange(64, device=device).reshape(2, 32) % 97 + dist.get_rank()
    losses, freed = [], []
    for _ in range(3):
        before = resident_bytes(model, optimizer, device)
        if offload:  # as while the rollouts are generated
            parked_params.park(parameters_and_gradients(model))
            parked_moments.park(optimizer_tensors(optimizer))
        freed.append(before - resident_bytes(model, optimizer, device))
        if offload:
            parked_params.restore(parameters_and_gradients(model))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if offload:
            parked_moments.restore(optimizer_tensors(optimizer))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, freed, shard_bytes, {name: p.to_local().detach().cpu() for name, p in model.named_parameters()}


def main() -> None:
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
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
