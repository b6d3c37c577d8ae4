"""Peak memory and time of the loss stage (output layer + cross-entropy, forward and backward) at a SmolLM2-size
(49k) and a Qwen2-size (151k) vocabulary, three ways:
- full logits and F.cross_entropy;
- fsdptrain's fused chunked sum (SFT: each chunk's gradients computed with its loss, three matmuls);
- fsdptrain's chunked per-token log-probs (RL: the backward takes a gradient per token and recomputes each
  chunk's logits, four matmuls), here summed into the same loss.

    python scripts/bench_logprob.py [--tokens 4096] [--hidden 896] [--chunk 1024] [--vocabs smollm2-49k qwen2-151k] [--json out.json]

Each measurement runs in a fresh process: on CPU the peak is the growth of the peak resident set size over
the inputs already allocated; on CUDA, torch.cuda.max_memory_allocated over the same baseline, measured (and
timed) after one untimed warm-up pass.
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

VOCABS = {"smollm2-49k": 49152, "qwen2-151k": 151936}


METHODS = ("full", "fused", "per-token")


def measure(tokens: int, hidden: int, vocab: int, chunk: int, method: str) -> dict:
    sys.path.insert(0, ".")
    from fsdptrain.models.loss import chunked_cross_entropy_sum, chunked_token_log_probs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    def stage() -> torch.Tensor:
        if method == "fused":
            return chunked_cross_entropy_sum(h, w, labels, chunk)
        if method == "per-token":
            return -chunked_token_log_probs(h, w, labels, 1.0, chunk, None)[0].sum()
        return torch.nn.functional.cross_entropy((h @ w.T).float(), labels, reduction="sum")

    if device.type == "cuda":
        stage().backward()  # untimed: the first call pays CUDA's one-time setup (kernels, cuBLAS handles)
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    loss = stage()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_mb": peak / 2**20, "seconds": time.perf_counter() - start, "loss": float(loss), "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (the model.chunked_loss_tokens default)")
    parser.add_argument("--vocabs", nargs="+", choices=list(VOCABS), default=list(VOCABS))
    parser.add_argument("--json")
    parser.add_argument("--measure", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        *sizes, method = args.measure
        print(json.dumps(measure(*map(int, sizes), method)))
        return

    rows = []
    for name in args.vocabs:
        vocab = VOCABS[name]
        for method in METHODS:
            chunk = 0 if method == "full" else args.chunk
            cmd = [sys.executable, __file__, "--measure", str(args.tokens), str(args.hidden), str(vocab), str(chunk), method]
            result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append({"vocab": name, "method": method, "chunk": chunk, **result})
    print(f"\nLoss stage, {args.tokens} tokens, hidden {args.hidden}, chunks of {args.chunk}, device {rows[0]['device']}")
    print(f"{'vocab':<12} {'method':<12} {'peak MB':>9} {'seconds':>8} {'loss':>12} {'memory saved':>13} {'time vs fused':>14}")
    for first in range(0, len(rows), len(METHODS)):
        full, fused, _ = group = rows[first : first + len(METHODS)]
        for row in group:
            saved = f"{full['peak_mb'] / row['peak_mb']:.1f}x" if row is not full else ""
            print(f"{row['vocab']:<12} {row['method']:<12} {row['peak_mb']:>9.0f} {row['seconds']:>8.2f} {row['loss']:>12.2f} "
                  f"{saved:>13} {row['seconds'] / fused['seconds']:>13.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
