"""Run under torchrun by test_gloo_reduce_scatter.py: ReusedBufferReduceScatter, called the way FSDP2 calls it
(allocate the input, allocate the output, reduce), against gloo's own reduce-scatter."""

import torch
import torch.distributed as dist

from fsdptrain.distributed.gloo_reduce_scatter import ReusedBufferReduceScatter

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
layer = 6 * world
# Three same-size groups (the decoder layers), one whose output has the layer's input size, three more layers, the
# root; then the next step's backward. A buffer is kept from the second input of a run of one size on. The outputs
# are kept, as FSDP keeps them as the sharded gradients.
sizes = [layer, layer, layer, layer * world, layer, layer, layer, 10 * world]
comm = ReusedBufferReduceScatter()
kept_outputs = []
for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
    for step in range(2):
        inputs = []
        for i, numel in enumerate(sizes):
            gradients = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + 10 * i + rank))
            input_tensor = comm.allocate((numel,), dtype=torch.float32, device=torch.device("cpu"))
            input_tensor.copy_(gradients)
            inputs.append(input_tensor)
            output = comm.allocate((numel // world,), dtype=torch.float32, device=torch.device("cpu"))
            comm(output, input_tensor, dist.group.WORLD, op)
            expected = torch.empty(numel // world)
            dist.reduce_scatter_tensor(expected, gradients, op=op)
            kept_outputs.append((output, expected))
        assert inputs[2] is inputs[1] and inputs[6] is inputs[5], "consecutive same-size inputs share one buffer"
        assert inputs[5] is not inputs[2] and inputs[1] is not inputs[0], "a buffer is kept only within a run of one size"
for output, expected in kept_outputs:
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
dist.destroy_process_group()
print("ok", rank)
