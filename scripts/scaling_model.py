"""Full sharding (FSDP over every GPU) against hybrid sharding (fsdp_size: shard within groups, replicate across) on
paper: each collective's bytes a GPU sends or receives per optimizer step, the time they take on the cluster's links,
and the sharded state's memory per GPU, for a model's parameter count and a cluster's shape.

    python scripts/scaling_model.py [--params 7e9 70e9] [--nodes 8] [--gpus-per-node 8] [--intra-gbs 370] [--inter-gbs 50]
        [--micro-batches 1] [--param-bytes 2] [--grad-bytes 4] [--state-bytes 16] [--gpu-memory-gb 80]

The model (FSDP2 as fsdptrain runs it, reshard_after_forward=true): per micro-batch, every parameter is
all-gathered twice (forward, and again for the backward) and every gradient reduce-scattered, each over the shard
group of W ranks: a ring moves (W - 1) / W of the whole tensor through each rank. Hybrid sharding then all-reduces
each rank's gradient shard across the R replicas: 2 (R - 1) / R of the shard. Parameters travel in the compute
dtype (`--param-bytes`, bf16), gradients in reduce_dtype (`--grad-bytes`, fp32 by default). A collective whose
group spans nodes runs at the inter-node bandwidth per GPU (`--inter-gbs`, GB/s: a 400 Gb/s NIC per GPU is 50),
one inside a node at NVLink's bus bandwidth (`--intra-gbs`). The sharded state (fp32 master weights, gradients
and AdamW's two moments: `--state-bytes` a parameter) divides over the shard group; activations, the gathered
layer and the rollout engine come on top. No overlap with compute is assumed: the times are what the
collectives cost, not the step.
"""

import argparse


def collectives(params: float, shard: int, replicas: int, micro_batches: int, param_bytes: float, grad_bytes: float) -> dict[str, float]:
    """Bytes through one GPU per optimizer step, by collective."""
    ring = (shard - 1) / shard
    out = {"all-gather": 2 * micro_batches * ring * params * param_bytes, "reduce-scatter": micro_batches * ring * params * grad_bytes}
    out["all-reduce"] = micro_batches * 2 * (replicas - 1) / replicas * params * grad_bytes / shard if replicas > 1 else 0.0
    return out


def layout(params: float, nodes: int, per_node: int, shard: int, args) -> dict:
    replicas = nodes * per_node // shard
    moved = collectives(params, shard, replicas, args.micro_batches, args.param_bytes, args.grad_bytes)
    shard_bandwidth = args.intra_gbs if shard <= per_node else args.inter_gbs
    seconds = (moved["all-gather"] + moved["reduce-scatter"]) / (shard_bandwidth * 1e9) + moved["all-reduce"] / (args.inter_gbs * 1e9)
    return {"shard": shard, "replicas": replicas, "bytes": moved, "seconds": seconds, "state_gb": params * args.state_bytes / shard / 1e9}


def table(params: float, args) -> str:
    world = args.nodes * args.gpus_per_node
    rows = [f"### {params / 1e9:g}B parameters on {args.nodes} x {args.gpus_per_node} GPUs", "",
            "| layout | shard group | replicas | all-gather GB | reduce-scatter GB | all-reduce GB | collectives s | sharded state GB/GPU | fits |",
            "|---|---|---|---|---|---|---|---|---|"]
    shard = args.gpus_per_node
    while shard <= world:
        r = layout(params, args.nodes, args.gpus_per_node, shard, args)
        name = "FSDP (fsdp_size=-1)" if shard == world else f"HSDP (fsdp_size={shard})"
        fits = "yes" if r["state_gb"] < args.gpu_memory_gb else "no"
        rows.append(f"| {name} | {shard} | {r['replicas']} | {r['bytes']['all-gather'] / 1e9:.1f} | {r['bytes']['reduce-scatter'] / 1e9:.1f} "
                    f"| {r['bytes']['all-reduce'] / 1e9:.1f} | {r['seconds']:.2f} | {r['state_gb']:.1f} | {fits} |")
        shard *= 2
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[7e9, 70e9])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-gbs", type=float, default=370.0, help="NVLink bus bandwidth per GPU, GB/s")
    parser.add_argument("--inter-gbs", type=float, default=50.0, help="inter-node bandwidth per GPU, GB/s (400 Gb/s = 50)")
    parser.add_argument("--micro-batches", type=int, default=1, help="forward/backward passes per optimizer step")
    parser.add_argument("--param-bytes", type=float, default=2.0, help="bytes a parameter travels in (bf16: 2)")
    parser.add_argument("--grad-bytes", type=float, default=4.0, help="bytes a gradient is reduced in (reduce_dtype fp32: 4)")
    parser.add_argument("--state-bytes", type=float, default=16.0, help="sharded bytes a parameter: fp32 weight, gradient, 2 AdamW moments")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    args = parser.parse_args()
    for params in args.params:
        print(table(params, args), end="\n\n")


if __name__ == "__main__":
    main()
