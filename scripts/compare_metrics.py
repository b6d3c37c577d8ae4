"""Compare two runs' metrics files step by step, as torchtitan's loss_compare does for a change that must not move
the numbers (a refactor, a new code path that should be equivalent).

    python scripts/compare_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl [--rtol 0] [--atol 0]

Timings, throughput and memory (`timing_s/`, `perf/`) differ between any two runs and are skipped; every other
key must be present in both at every step and equal within the tolerances (exactly, by default). Exits 1 and
names each difference otherwise.
"""

import argparse
import json
import math
import sys

SKIPPED = ("timing_s/", "perf/")


def read(path: str) -> dict[int, dict]:
    with open(path) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def differences(a: dict[int, dict], b: dict[int, dict], rtol: float, atol: float) -> list[str]:
    found = [] if a.keys() == b.keys() else [f"steps differ: {sorted(a)} against {sorted(b)}"]
    for step in sorted(a.keys() & b.keys()):
        keys_a = {k for k in a[step] if not k.startswith(SKIPPED)}
        keys_b = {k for k in b[step] if not k.startswith(SKIPPED)}
        found += [f"step {step}: {key} only in one run" for key in sorted(keys_a ^ keys_b)]
        for key in sorted(keys_a & keys_b):
            x, y = a[step][key], b[step][key]
            if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=rtol, abs_tol=atol)):
                found.append(f"step {step}: {key} {x!r} != {y!r}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--rtol", type=float, default=0.0)
    parser.add_argument("--atol", type=float, default=0.0)
    args = parser.parse_args()
    a, b = read(args.a), read(args.b)
    found = differences(a, b, args.rtol, args.atol)
    for line in found:
        print(line)
    compared = sum(len([k for k in a[s] if not k.startswith(SKIPPED)]) for s in a.keys() & b.keys())
    print(f"{len(a.keys() & b.keys())} steps, {compared} values compared: {'equal' if not found else f'{len(found)} differences'}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
