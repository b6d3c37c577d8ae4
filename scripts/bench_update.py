"""One micro-batch of the policy update through the plain model, phase by phase: where a CPU spends the update's
time before FSDP adds its gathers (docs/performance.md, issue 80).

    python scripts/bench_update.py MODEL_DIR [--tokens 800] [--target-share 0.67] [--repeats 2] [--avx2] [--profile]

One packed row of `--tokens` random ids, the last `--target-share` of them with a target; the decoder forward, the
project's chunked log-prob head (temperature 0.7, with the entropy, as the GRPO update runs it) and the backward of
a random per-token loss, timed on one thread in fp32 after a warm-up; `--avx2` reruns itself with torch, oneDNN
and MKL held to AVX2; `--profile` adds torch.profiler's operator table of one more pass.
"""

import argparse
import os
import subprocess
import sys
import time

from bench_matmul import AVX2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=800)
    parser.add_argument("--target-share", type=float, default=0.67)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.avx2 and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":  # the variables are read when torch loads
        sys.exit(subprocess.run([sys.executable, *sys.argv], env={**os.environ, **AVX2}).returncode)

    import torch
    from transformers import AutoModelForCausalLM

    from fsdptrain.models.loss import chunked_token_log_probs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    targets = torch.arange(int(args.tokens * (1 - args.target_share)), args.tokens)

    def one_pass() -> tuple[float, float, float]:
        start = time.perf_counter()
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        forward = time.perf_counter()
        log_probs, _ = chunked_token_log_probs(hidden[targets], model.lm_head.weight, ids[0, targets], 0.7, 1024, "entropy")
        head = time.perf_counter()
        (log_probs * torch.randn_like(log_probs)).sum().backward()
        model.zero_grad(set_to_none=True)
        return forward - start, head - forward, time.perf_counter() - head

    one_pass()
    print(f"{args.tokens} tokens, {len(targets)} with a target, torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for _ in range(args.repeats):
        forward, head, backward = one_pass()
        print(f"decoder forward {forward:.2f} s   log-prob head {head:.2f} s   backward {backward:.2f} s   total {forward + head + backward:.2f} s")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            one_pass()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
