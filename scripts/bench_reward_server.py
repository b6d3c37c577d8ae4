"""Load test of `python -m fsdptrain.reward_server`: requests per second and latency at several client counts.

    python scripts/bench_reward_server.py [--builtin gsm8k | --model DIR] [--clients 1 8 64] [--requests 400] [--texts 8] [--json out.json]

The server runs in its own process on the loopback address; each client is a thread with its own connection that
sends requests of `--texts` GSM8K-style responses back to back, `--requests` requests in all per client count.
Latency is from sending a request to its parsed reply.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def payload(texts: int, offset: int) -> dict:
    prompts = [f"Question {offset + i}: what is {i} plus {offset}? " for i in range(texts)]
    return {"query": [p + f"It is {i + offset}.\n#### {i + offset}" for i, p in enumerate(prompts)], "prompts": prompts,
            "labels": [str(i + offset) for i in range(texts)], "data_sources": ["gsm8k"] * texts}


def load(url: str, clients: int, requests: int, texts: int) -> dict:
    per_client = max(1, requests // clients)

    def client(index: int) -> list[float]:
        latencies = []
        with httpx.Client(timeout=60.0) as http:
            for k in range(per_client):
                start = time.perf_counter()
                reply = http.post(url, json=payload(texts, index * per_client + k))
                rewards = reply.json()["rewards"]
                latencies.append(time.perf_counter() - start)
                assert len(rewards) == texts and all(r == 1.0 for r in rewards), rewards
        return latencies

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = [x for part in pool.map(client, range(clients)) for x in part]
    seconds = time.perf_counter() - start
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(latencies), "texts_per_request": texts, "requests_per_s": len(latencies) / seconds,
            "texts_per_s": len(latencies) * texts / seconds, "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builtin", default="gsm8k")
    parser.add_argument("--model", help="serve a reward model folder instead (its scores are not checked)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--requests", type=int, default=400, help="requests per client count")
    parser.add_argument("--texts", type=int, default=8, help="responses per request")
    parser.add_argument("--json")
    args = parser.parse_args()
    port = free_port()
    source = ["--model", args.model] if args.model else ["--builtin", args.builtin]
    server = subprocess.Popen([sys.executable, "-m", "fsdptrain.reward_server", *source, "--port", str(port)], cwd=os.path.dirname(HERE))
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.post(url, json={"query": []}, timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the reward server did not start") from None
                time.sleep(0.2)
        rows = [load(url, clients, args.requests, args.texts) for clients in args.clients]
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"reward server ({' '.join(source)}), {args.texts} texts a request, {os.cpu_count()} cores")
    print(f"{'clients':>7} {'requests':>8} {'req/s':>8} {'texts/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(f"{r['clients']:>7} {r['requests']:>8} {r['requests_per_s']:>8.0f} {r['texts_per_s']:>8.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": source, "texts": args.texts, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
