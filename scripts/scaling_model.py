"""Full sharding (FSDP over every GPU) against hybrid sharding (fsdp_size: shard within groups, replicate across) on
paper: each collective's bytes a GPU sends or receives per optimizer step, the time they take on the cluster's links,
and the sharded state's memory per GPU, for a model's parameter count and a cluster's shape. With --rl, instead: a
GRPO step's time in the sync mode, separate_async and colocate_async (docs/async.md) on one node, from per-token costs.

    python scripts/scaling_model.py [--params 7e9 70e9] [--nodes 8] [--gpus-per-node 8] [--intra-gbs 370] [--inter-gbs 50]
        [--micro-batches 1] [--param-bytes 2] [--grad-bytes 4] [--state-bytes 16] [--gpu-memory-gb 80]
    python scripts/scaling_model.py --rl [--gpus-per-node 8] [--prompts 256] [--responses 8] [--short-tokens 256]
        [--long-every 10] [--long-factor 8] [--decode-step-ms 20] [--decode-seq-us 15] [--train-token-us 25] [--lead 1]

The RL model: decoding is a step per token for all the sequences an engine holds, each step costing
`--decode-step-ms` plus `--decode-seq-us` a sequence held (the hf engine's decode is bound by its launches and the
weights' reads, not by the batch, at these sizes); training costs `--train-token-us` a token on one GPU and divides
over the training GPUs. Every `--long-every`-th prompt's responses run `--long-factor` times the others'
(`--short-tokens`). The defaults are the 1B Llama's measured costs on one H200 (docs/performance.md: 128-token
decodes of 128 sequences in 2.8 s, the update 0.4 s for 16k tokens). Sync: every GPU decodes its share until its
longest response ends, then every GPU trains. separate_async (R GPUs generate, the others train, batches asked
ahead): a step is the slower of the two sides, the generation of a batch on R GPUs still held by its longest
response; the best R is shown. colocate_async: a step decodes its share plus the batch in flight ahead and the long
responses still going, until a batch's worth of groups is whole (about the short responses' length), then trains; a
long response goes on over the next steps, long-factor steps in all (its lag: raise max_off_policy_threshold to it).
Weight syncs and prefills are left out.


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


def rl_steps(args) -> dict[str, dict]:
    """Each mode's predicted step: seconds generating, training and in all, the samples a second."""
    gpus, sequences = args.gpus_per_node, args.prompts * args.responses
    long_tokens = args.short_tokens * args.long_factor
    tokens = sequences * (args.short_tokens * (1 - 1 / args.long_every) + long_tokens / args.long_every)
    decode = lambda steps, held: steps * (args.decode_step_ms / 1e3 + args.decode_seq_us / 1e6 * held)  # noqa: E731
    train = lambda ranks: tokens * args.train_token_us / 1e6 / ranks  # noqa: E731
    modes = {}
    gen, update = decode(long_tokens, sequences / gpus), train(gpus)
    modes["sync"] = {"gpus": f"{gpus} generate, then train", "gen_s": gen, "train_s": update, "step_s": gen + update}
    best = None
    for rollout in range(1, gpus):
        gen, update = decode(long_tokens, sequences / rollout), train(gpus - rollout)
        if best is None or max(gen, update) < best["step_s"]:
            best = {"gpus": f"{rollout} generate + {gpus - rollout} train", "gen_s": gen, "train_s": update, "step_s": max(gen, update)}
    modes["separate_async"] = best
    # in flight on a GPU: its share of the step's batch and of the batches ahead, and the long responses of the
    # long_factor - 1 batches before that are still going
    held = sequences / gpus * (1 + args.lead + (args.long_factor - 1) / args.long_every)
    gen, update = decode(args.short_tokens, held), train(gpus)
    modes["colocate_async"] = {"gpus": f"{gpus} generate and train", "gen_s": gen, "train_s": update, "step_s": gen + update}
    for mode in modes.values():
        mode["samples_per_s"] = sequences / mode["step_s"]
    return modes


def rl_table(args) -> str:
    modes = rl_steps(args)
    rows = [f"### GRPO steps of {args.prompts} prompts x {args.responses} responses on {args.gpus_per_node} GPUs: responses of "
            f"{args.short_tokens} tokens, every {args.long_every}th prompt's {args.long_factor}x longer", "",
            "| mode | GPUs | generation s | training s | step s | samples/s | vs sync |", "|---|---|---|---|---|---|---|"]
    for name, m in modes.items():
        rows.append(f"| {name} | {m['gpus']} | {m['gen_s']:.1f} | {m['train_s']:.1f} | {m['step_s']:.1f} | {m['samples_per_s']:.0f} "
                    f"| {m['samples_per_s'] / modes['sync']['samples_per_s']:.2f}x |")
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
    parser.add_argument("--rl", action="store_true", help="the three GRPO modes' steps instead (one node of --gpus-per-node GPUs)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=256, help="the length of most responses")
    parser.add_argument("--long-every", type=int, default=10, help="every this many-th prompt's responses are long")
    parser.add_argument("--long-factor", type=float, default=8.0, help="how many times longer those are")
    parser.add_argument("--decode-step-ms", type=float, default=20.0, help="a decoding step's fixed cost on one GPU")
    parser.add_argument("--decode-seq-us", type=float, default=15.0, help="a decoding step's cost a sequence held")
    parser.add_argument("--train-token-us", type=float, default=25.0, help="the update's cost a token on one GPU")
    parser.add_argument("--lead", type=int, default=1, help="batches ahead: num_warmup_batches")
    args = parser.parse_args()
    if args.rl:
        print(rl_table(args))
        return
    for params in args.params:
        print(table(params, args), end="\n\n")


if __name__ == "__main__":
    main()
