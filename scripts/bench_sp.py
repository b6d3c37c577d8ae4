"""Ulysses sequence parallelism: activation memory per rank and step time for S = 1, 2, 4 at one long row.

    python scripts/bench_sp.py [--seq-len 8192] [--sizes 1 2 4] [--layers 4] [--hidden 256] [--json out.json]

For each S it launches `torchrun --nproc_per_node=S` on this script's worker, which builds a sharded model
through fsdptrain's own path (build_model, packing, sequence sharding, token_nll_sum) and times forward +
backward of one packed row of four sequences. Activation memory is what autograd keeps for the backward
(saved tensors that are not parameters), counted once per storage: the quantity Ulysses divides by S.
On CUDA the peak of torch.cuda.max_memory_allocated is reported too.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def build_folder(path: str, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.seq_len, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)


# long: one measured run, set-up to teardown, in the order its timings are taken
def worker(args) -> None:
    import torch.distributed as dist

    from fsdptrain.config.base import defaults, to_typed
    from fsdptrain.config.sft import SFTModelConfig
    from fsdptrain.data.dataset import Sample
    from fsdptrain.data.micro_batches import collate
    from fsdptrain.distributed.mesh import init_parallel
    from fsdptrain.models.loading import build_model, load_model_config
    from fsdptrain.models.loss import token_nll_sum

    parallel = init_parallel("auto", int(os.environ["WORLD_SIZE"]))
    defaults = defaults("sft_trainer").model
    defaults.partial_pretrain = args.model
    defaults.enable_gradient_checkpointing = False
    model_config = to_typed(defaults, SFTModelConfig)
    hf_config = load_model_config(args.model, "model", model_config, parallel.sp_size)
    model = build_model(args.model, model_config, model_config.fsdp_config, hf_config, parallel, packed=True, trainable=True)

    g = torch.Generator().manual_seed(0)
    quarter = args.seq_len // 4
    samples = [Sample(torch.randint(0, args.vocab, (quarter,), generator=g), torch.ones(quarter, dtype=torch.long)) for _ in range(4)]
    batch = collate(samples, packed=True, pad_token_id=0, parallel=parallel)

    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step() -> float:
        saved.clear()
        if parallel.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = token_nll_sum(model, batch.inputs, batch.targets["labels"], model_config.chunked_loss_tokens, parallel.ulysses_group)
        loss.backward()
        if parallel.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    if parallel.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.iters)]
    result = {
        "sp": parallel.sp_size,
        "tokens_per_rank": batch.inputs["input_ids"].shape[1],
        "step_s": statistics.median(times),
        "activation_mb": sum(saved.values()) / 2**20,
        "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if parallel.device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if parallel.device.type == "cuda" else "cpu",
    }
    if parallel.is_main:
        with open(args.result, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        build_folder(model, args)
        for size in args.sizes:
            out = os.path.join(tmp, f"sp{size}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={size}", __file__,
                   "--worker", "--model", model, "--result", out, "--seq-len", str(args.seq_len), "--vocab", str(args.vocab),
                   "--iters", str(args.iters)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                results.append(json.load(f))
    base = results[0]
    print(f"\nUlysses SP, one packed row of {args.seq_len} tokens (4 sequences), Llama {args.layers}x{args.hidden}, "
          f"vocab {args.vocab}, device {base['device']}")
    print(f"{'S':>3} {'tokens/rank':>12} {'step s':>8} {'x S=1':>6} {'activation MB/rank':>19} {'x S=1':>6}"
          + (f" {'CUDA peak MB':>13}" if base["cuda_peak_mb"] else ""))
    for r in results:
        row = (f"{r['sp']:>3} {r['tokens_per_rank']:>12} {r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>6.2f} "
               f"{r['activation_mb']:>19.1f} {r['activation_mb'] / base['activation_mb']:>6.2f}")
        print(row + (f" {r['cuda_peak_mb']:>13.1f}" if r["cuda_peak_mb"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seq_len": args.seq_len, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
