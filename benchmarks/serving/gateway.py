"""Shared-prefix serving through the SMG gateway over two kvserve replicas: the cache-aware policy
(fed by the replicas' KV-cache events) against round robin, in one run, with one replica alone
as the reference hit rate, and the gateway's own cost per request against calling a replica
directly.

The workload: ``--prefixes`` long system prompts, ``--users`` users each; every user asks one
short question after its prompt's prefix, and the requests arrive interleaved (prefix 0 user 0,
prefix 1 user 0, ..., prefix 0 user 1, ...) from ``--concurrency`` clients. Each configuration
starts from empty prefix caches (FlushCache). Reported per configuration: the prefix-cache hit
rate over all requests (cached prompt tokens / prompt tokens, from the responses' usage), TTFT
p50/p99 (first streamed text, as the OpenAI client sees it) and output tokens per second.

    python -m kvserve.benchmarks.serving.gateway                 # the bundled model
    python -m kvserve.benchmarks.serving.gateway --model DIR     # any model directory
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import threading
import time

import grpc

from kvserve.clients import Client
from kvserve.testing.gateway import Gateway
from kvserve.testing.process import ServerProcess
from kvserve.vllm import smg_common_pb2, vllm_engine_pb2_grpc

WORDS = ("river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "engine", "orchard", "signal",
         "canyon", "ember", "glacier", "thimble", "compass", "willow", "saddle", "quartz", "beacon", "tundra")


def prompts(prefixes: int, users: int, prefix_words: int) -> list[str]:
    """Interleaved: every prefix's first user, then every prefix's second user, ..."""
    systems = [" ".join(f"{WORDS[(p * 7 + i) % len(WORDS)]}{p}" for i in range(prefix_words))
               for p in range(prefixes)]
    return [f"{systems[p]}\nUser {u}: tell me about {WORDS[(u + p) % len(WORDS)]} number {u * 13 + p}."
            for u in range(users) for p in range(prefixes)]


def flush(targets: list[str]) -> None:
    for t in targets:
        with grpc.insecure_channel(t) as ch:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
            ok = stub.FlushCache(smg_common_pb2.FlushCacheRequest(timeout_s=30))
        if not ok.success:
            raise RuntimeError(f"FlushCache on {t}: {ok.message}")


def run_workload(gateway: Gateway, texts: list[str], max_tokens: int, concurrency: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=600)
    lock = threading.Lock()
    ttfts, prompt_tokens, cached, outputs = [], 0, 0, 0

    def one(text: str) -> None:
        nonlocal prompt_tokens, cached, outputs
        start = time.monotonic()
        first = None
        usage = None
        for chunk in client.completions.create(model=gateway.model, prompt=text, max_tokens=max_tokens,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - start
            usage = chunk.usage or usage
        with lock:
            ttfts.append(first if first is not None else time.monotonic() - start)
            prompt_tokens += usage.prompt_tokens
            cached += (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
            outputs += usage.completion_tokens

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, texts))
    wall = time.monotonic() - start
    ttfts.sort()
    return {"requests": len(texts), "hit_rate": cached / prompt_tokens,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "output_tok_s": outputs / wall, "wall_s": wall}


def gateway_cost(gateway: Gateway, target: str, n: int) -> dict:
    """Median latency of a one-token completion through the gateway and directly (kvserve.v1)."""
    import openai

    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)
    text = "The capital of France is"
    via, direct = [], []
    with Client(target) as c:
        for _ in range(n):
            t = time.monotonic()
            client.completions.create(model=gateway.model, prompt=text, max_tokens=1, temperature=0)
            via.append(time.monotonic() - t)
            t = time.monotonic()
            c.generate(text, max_tokens=1, temperature=0)
            direct.append(time.monotonic() - t)
    p50_via, p50_direct = statistics.median(via), statistics.median(direct)
    return {"via_gateway_p50_ms": 1000 * p50_via, "direct_p50_ms": 1000 * p50_direct,
            "gateway_cost_ms": 1000 * (p50_via - p50_direct)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    # odd: with an even count, round robin over two replicas would send each prefix to one replica
    # every time by the interleaving alone (prefix i % P on replica i % 2)
    ap.add_argument("--prefixes", type=int, default=5)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=200, help="words per system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    flags = ("--model", args.model, "--kv-events", "--kv-cache-memory", "0.5")
    servers = [ServerProcess(*flags, env={"OMP_NUM_THREADS": "1"}) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        targets = [s.target for s in servers]
        texts = prompts(args.prefixes, args.users, args.prefix_words)
        results = {}
        for name, policy, workers in (("one replica", "cache_aware", targets[:1]),
                                      ("cache-aware + KV events", "cache_aware", targets),
                                      ("round robin", "round_robin", targets)):
            flush(targets)
            with Gateway(workers, policy) as gw:
                results[name] = run_workload(gw, texts, args.max_tokens, args.concurrency)
                if name == "one replica":
                    results["gateway cost"] = gateway_cost(gw, targets[0], 20)
                print(f"{name}: {json.dumps(results[name])}", flush=True)
    finally:
        for s in servers:
            s.stop()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


def print_table(results: dict) -> None:
    print("| configuration | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        if "hit_rate" in r:
            print(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                  f"{r['output_tok_s']:.1f} |")
    cost = results["gateway cost"]
    print(f"\none-token completion, median: {cost['via_gateway_p50_ms']:.1f} ms through the gateway, "
          f"{cost['direct_p50_ms']:.1f} ms direct (kvserve.v1 Generate): the gateway adds "
          f"{cost['gateway_cost_ms']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
