"""Peak memory and time of the loss stage (output layer + cross-entropy, forward and backward), full logits
vs fsdptrain's chunked linear cross-entropy, at a SmolLM2-size (49k) and a Qwen2-size (151k) vocabulary.

    python scripts/bench_logprob.py [--tokens 4096] [--hidden 896] [--chunk 1024] [--json out.json]

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


def measure(tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    sys.path.insert(0, ".")
    from fsdptrain.models.loss import chunked_cross_entropy_sum

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    def stage() -> torch.Tensor:
        if chunk:
            return chunked_cross_entropy_sum(h, w, labels, chunk)
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
    parser.add_argument("--json")
    parser.add_argument("--measure", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    rows = []
    for name, vocab in VOCABS.items():
        for chunk in (0, args.chunk):
            cmd = [sys.executable, __file__, "--measure", str(args.tokens), str(args.hidden), str(vocab), str(chunk)]
            result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows.append({"vocab": name, "chunk": chunk, **result})
    print(f"\nLoss stage, {args.tokens} tokens, hidden {args.hidden}, device {rows[0]['device']}")
    print(f"{'vocab':<12} {'method':<16} {'peak MB':>9} {'seconds':>8} {'loss':>12} {'memory saved':>13}")
    for full, chunked in zip(rows[::2], rows[1::2]):
        for row in (full, chunked):
            method = f"chunked {row['chunk']}" if row["chunk"] else "full logits"
            saved = f"{full['peak_mb'] / row['peak_mb']:.1f}x" if row["chunk"] else ""
            print(f"{row['vocab']:<12} {method:<16} {row['peak_mb']:>9.0f} {row['seconds']:>8.2f} {row['loss']:>12.2f} {saved:>13}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
