"""Run under torchrun by test_gloo_comms.py: the comms of fsdptrain/distributed/gloo_comms.py, called the way
FSDP2 calls them, against gloo's own collectives."""

import torch
import torch.distributed as dist

from fsdptrain.distributed.gloo_comms import PointToPointAllGather, PointToPointReduceScatter


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu = torch.device("cpu")

    # Reduce-scatter, over the world and over groups of two ranks (whose group ranks differ from the global ones).
    # Three same-size groups (the decoder layers), one whose output has the layer's input size, three more layers,
    # the root; then the next step's backward. A buffer is kept from the second input of a run of one size on. The
    # outputs are kept, as FSDP keeps them as the sharded gradients.
    pairs, _ = dist.new_subgroups(2)
    kept_outputs = []
    for group in (dist.group.WORLD, pairs):
        size = dist.get_world_size(group)
        layer = 6 * size
        sizes = [layer, layer, layer, layer * size, layer, layer, layer, 10 * size]
        comm = PointToPointReduceScatter()
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            for step in range(2):
                inputs = []
                for i, numel in enumerate(sizes):
                    gradients = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + 10 * i + rank))
                    input_tensor = comm.allocate((numel,), dtype=torch.float32, device=cpu)
                    input_tensor.copy_(gradients)
                    inputs.append(input_tensor)
                    output = comm.allocate((numel // size,), dtype=torch.float32, device=cpu)
                    comm(output, input_tensor, group, op)
                    expected = torch.empty(numel // size)
                    dist.reduce_scatter_tensor(expected, gradients, op=op, group=group)
                    kept_outputs.append((output, expected))
                assert inputs[2] is inputs[1] and inputs[6] is inputs[5], "consecutive same-size inputs share one buffer"
                assert inputs[5] is not inputs[2] and inputs[1] is not inputs[0], "a buffer is kept only within a run of one size"
    for output, expected in kept_outputs:
        torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)

    # All-gather, over the world and over groups of two ranks (whose group ranks differ from the global ones). FSDP2
    # passes an input that is this rank's slot of the output; a separate input works too.
    all_gather = PointToPointAllGather()
    for group in (dist.group.WORLD, pairs):
        size = dist.get_world_size(group)
        for shard_numel in (7, 1000):
            shard = torch.randn(shard_numel, generator=torch.Generator().manual_seed(shard_numel + rank))
            expected = torch.empty(shard_numel * size)
            dist.all_gather_into_tensor(expected, shard, group=group)
            output = all_gather.allocate((shard_numel * size,), dtype=torch.float32, device=cpu)
            slot = output.view(size, -1)[dist.get_group_rank(group, rank)]
            slot.copy_(shard)
            all_gather(output, slot, group)
            torch.testing.assert_close(output, expected, rtol=0, atol=0)
            separate = all_gather.allocate((shard_numel * size,), dtype=torch.float32, device=cpu)
            all_gather(separate, shard.clone(), group)
            torch.testing.assert_close(separate, expected, rtol=0, atol=0)
    dist.destroy_process_group()
    print("ok", rank)


if __name__ == "__main__":
    main()
