"""One thread's matmul speed in fp32 and bf16, on this CPU as it is and with torch, oneDNN and MKL held to AVX2: how
close that approximates a CPU without AVX512-BF16 or AMX, where bf16 is emulated (the quickstart's fp32 path).

    python scripts/bench_matmul.py [--size 1024] [--seconds 3]

Each setting runs in its own process (the variables are read when torch loads) with one thread; prints GFLOP/s
per dtype, the bf16 / fp32 ratio, and torch's CPU capability.
"""

import argparse
import json
import os
import subprocess
import sys

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
MEASURE = """
import json, sys, time, torch
torch.set_num_threads(1)
size, seconds = int(sys.argv[1]), float(sys.argv[2])
speeds = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or runs < 2:
        a @ b
        runs += 1
    speeds[name] = 2 * size**3 * runs / (time.perf_counter() - start) / 1e9
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), **speeds}))
"""


def measure(env: dict, size: int, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(size), str(seconds)], env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"{'setting':<10} {'capability':<12} {'fp32 GFLOP/s':>13} {'bf16 GFLOP/s':>13} {'bf16/fp32':>10}")
    for name, env in (("as is", {}), ("AVX2", AVX2)):
        r = measure(env, args.size, args.seconds)
        print(f"{name:<10} {r['capability']:<12} {r['fp32']:>13.1f} {r['bf16']:>13.1f} {r['bf16'] / r['fp32']:>10.3f}")


if __name__ == "__main__":
    main()
