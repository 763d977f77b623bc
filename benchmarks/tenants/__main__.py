"""Two tenants on one server, fair scheduling against first come first served, in one run.

- **flood**: tenant "flood" holds ``--flood-calls`` Stream calls of n=``--flood-n`` choices with
  ``--flood-prompt``-token prompts that it never reads; tenant "interactive" sends ``--requests``
  short requests one after another (and more until ``--window`` seconds passed). Reported: the
  interactive TTFT p50/p99 alone and under the flood, with ``--scheduling-policy fair`` and
  ``fcfs``, and the server's total generated tokens per second over that window (Stats); from the
  server's step trace (``--step-trace``, benchmarks/tenants/trace.py), the steps each of the five
  largest TTFTs under the flood waited on, and the window's steps by kind.
- **weights**: tenants "a" and "b" (``--tenant-weights a=3,b=1``) each keep ``--flood-calls``
  Stream calls of n=``--flood-n`` busy (read, and sent again as they end) for ``--window`` seconds;
  reported: each tenant's share of the generated tokens (target 0.75 / 0.25).
- **overload**: one tenant sends short requests at ``--rate`` per second (more than the server
  finishes) for ``--window`` seconds, each of ``--tokens`` tokens with a ``--deadline`` s gRPC deadline;
  reported: goodput, the requests finished within their deadline per second, and how the rest ended
  (refused at once with DEADLINE_EXCEEDED by the fair policy, which predicts each request's start and
  finish, or expired), fair against fcfs.

    python -m kvserve.benchmarks.tenants                     # the bundled model, full size
    python -m kvserve.benchmarks.tenants --model DIR --requests 5 --window 5   # a quick look
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvserve.benchmarks.tenants.trace import Trace, by_kind, waited_on
from kvserve.clients.messages import build_request
from kvserve.testing.process import ServerProcess
from kvserve.v1 import llm_pb2, llm_pb2_grpc

HEADER = "x-tenant-id"
SHORT_PROMPT = [9707, 11, 1246, 525, 498, 30] * 4  # 24 ids, valid in any vocabulary of 10k+
LARGEST = 5  # the interactive TTFTs under the flood listed with their request's number (0: the first)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.tenants",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--flood-calls", type=int, default=4, help="never-read Stream calls of the flood tenant")
    p.add_argument("--flood-n", type=int, default=16, help="choices per flood call")
    p.add_argument("--flood-prompt", type=int, default=1024, help="prompt tokens of a flood call")
    p.add_argument("--flood-tokens", type=int, default=1024, help="max_tokens of a flood choice")
    p.add_argument("--requests", type=int, default=40, help="interactive requests per configuration")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of an interactive request")
    p.add_argument("--window", type=float, default=60.0, help="seconds of the weights and overload runs")
    p.add_argument("--rate", type=float, default=8.0, help="overload arrivals per second")
    p.add_argument("--deadline", type=float, default=5.0, help="overload requests' gRPC deadline, seconds")
    p.add_argument("--runs", default="flood,weights,overload", help="which runs, comma separated")
    p.add_argument("--policies", default="fair,fcfs", help="the flood run's policies, comma separated")
    p.add_argument("--trace-dir", default=None, help="keep the flood runs' step traces here (POLICY.jsonl; "
                   "default: a temporary directory, removed)")
    p.add_argument("--server-flags", default="", help="more `kvserve serve` flags for every server, e.g. "
                   "\"--tenant-row-cost 0.2 --tenant-linger-ms 500\" (docs/serving/tenants.md)")
    return p.parse_args()


def server(args, *flags: str) -> ServerProcess:
    return ServerProcess("--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
                         "--max-model-len", str(args.flood_prompt + args.flood_tokens + 16),
                         "--cache-salt-from", "header", "--cache-salt-header", HEADER, *flags,
                         *shlex.split(args.server_flags))


def meta(tenant: str):
    return ((HEADER, tenant),)


def stats(stub) -> llm_pb2.StatsResponse:
    return stub.Stats(llm_pb2.StatsRequest(), timeout=60)


def long_prompt(args, salt: int) -> list[int]:
    return [1000 + (salt * 31 + i * 7) % 8000 for i in range(args.flood_prompt)]


def flood_request(args, salt: int) -> llm_pb2.GenerateRequest:
    return build_request(token_ids=long_prompt(args, salt), max_tokens=args.flood_tokens, ignore_eos=True,
                         n=args.flood_n, temperature=1.0, request_id=f"flood-{salt}")


def ttft(stub, tenant: str, args, timeout: float = 600) -> float:
    """Seconds to the first streamed token of one short request (read to its end)."""
    return timed(stub, tenant, args, timeout, f"{tenant}-warm")[0]


def timed(stub, tenant: str, args, timeout: float = 600, request_id: str = "") -> tuple[float, float, float]:
    """The client's seconds to the first streamed token of one short request (read to its end), the
    server's (its ``Timing.ttft_ms``: from the call's arrival to the engine's first token, so the gap
    between the two is the time outside the engine: the client, gRPC and the front-end), and when it was
    sent (``time.monotonic()``, the server's step trace's clock on this machine)."""
    request = build_request(token_ids=SHORT_PROMPT, max_tokens=args.tokens, ignore_eos=True, temperature=0.0,
                            request_id=request_id)
    start, first, server = time.monotonic(), None, float("nan")
    for msg in stub.Stream(request, metadata=meta(tenant), timeout=timeout):
        if first is None and msg.token_ids:
            first = time.monotonic() - start
        if msg.HasField("timing"):
            server = msg.timing.ttft_ms / 1000
    return first, server, start


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def interactive(stub, args, seconds: float = 0.0, label: str = "interactive") -> dict:
    """TTFTs of ``--requests`` short requests one after another, and more until ``seconds`` passed
    (the window over which the server's generated tokens per second are counted); request ids
    ``LABEL-0``, ``LABEL-1``..."""
    before, start = stats(stub), time.monotonic()
    times, server, sent = [], [], []
    while len(times) < args.requests or time.monotonic() - start < seconds:
        client, engine, at = timed(stub, "interactive", args, request_id=f"{label}-{len(times)}")
        times.append(client)
        server.append(engine)
        sent.append(at)
    after, elapsed = stats(stub), time.monotonic() - start
    tokens = after.generation_tokens_total - before.generation_tokens_total
    largest = sorted(range(len(times)), key=lambda i: -times[i])[:LARGEST]
    return {"p50": p(times, 0.5), "p99": p(times, 0.99), "first": times[0], "n": len(times),
            "next_max": max(times[1:], default=times[0]), "tok_s": tokens / elapsed,
            "largest": [(i, times[i], server[i], sent[i]) for i in largest],
            "window": (start, start + elapsed)}


def wait_running(stub, count: int, calls=()) -> None:
    """Until ``count`` sequences run; an error naming the call's status if one of ``calls`` ended first
    (refused, e.g. by deadline-aware admission on a busy machine whose step times are far off)."""
    for _ in range(6000):
        if stats(stub).num_running >= count:
            return
        for call in calls:
            if call.done():
                raise RuntimeError(f"a flood call ended before the flood ran: {call.code()} {call.details()}")
        time.sleep(0.1)
    raise RuntimeError(f"the flood never reached {count} running sequences")


def flood_run(args, policy: str, trace_dir: str) -> dict:
    trace = os.path.join(trace_dir, f"{policy}.jsonl")
    if os.path.exists(trace):
        os.remove(trace)  # (the server appends)
    with server(args, "--scheduling-policy", policy, "--step-trace", trace) as srv, \
            grpc.insecure_channel(srv.target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        ttft(stub, "interactive", args)  # warm
        alone = interactive(stub, args, label="interactive-alone")
        calls = [stub.Stream(flood_request(args, i), metadata=meta("flood"), timeout=3600)
                 for i in range(args.flood_calls)]
        try:
            wait_running(stub, min(args.max_num_seqs, args.flood_calls * args.flood_n), calls)
            loaded = interactive(stub, args, args.window)
        finally:
            for c in calls:
                c.cancel()
    return {"alone": alone, "flood": loaded, "trace": Trace(trace)}


def weights_run(args) -> dict[str, int]:
    tokens = {"a": 0, "b": 0}
    lock, stop, counting = threading.Lock(), threading.Event(), threading.Event()

    def keep_busy(stub, tenant: str, salt: int) -> None:
        while not stop.is_set():
            call = stub.Stream(flood_request(args, salt), metadata=meta(tenant), timeout=3600)
            try:
                for msg in call:
                    with lock:
                        if counting.is_set():
                            tokens[tenant] += len(msg.token_ids)
                    if stop.is_set():
                        call.cancel()
                        break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    raise

    with server(args, "--tenant-weights", "a=3,b=1") as srv, grpc.insecure_channel(srv.target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        with ThreadPoolExecutor(2 * args.flood_calls) as pool:
            jobs = [pool.submit(keep_busy, stub, t, i) for t in "ab" for i in range(args.flood_calls)]
            wait_running(stub, min(args.max_num_seqs, 2 * args.flood_calls * args.flood_n))
            counting.set()
            time.sleep(args.window)
            counting.clear()
            stop.set()
            for j in jobs:
                j.result()
    return tokens


def overload_run(args, policy: str) -> dict:
    outcomes = {"ok": 0, "refused": 0, "expired": 0, "other": 0}
    lock = threading.Lock()

    def one(stub) -> None:
        request = build_request(token_ids=SHORT_PROMPT, max_tokens=args.tokens, ignore_eos=True,
                                temperature=0.0)
        try:
            stub.Generate(request, metadata=meta("load"), timeout=args.deadline)
            kind = "ok"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # the server's refusals at admission name the step time model (engine/tenancy/deadlines.py)
                kind = "refused" if "(step time model)" in (e.details() or "") else "expired"
            else:
                kind = "other"
        with lock:
            outcomes[kind] += 1

    with server(args, "--scheduling-policy", policy, "--max-queue", "100000") as srv, \
            grpc.insecure_channel(srv.target) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        ttft(stub, "load", args)  # warm (and teaches the step time model)
        count = int(args.rate * args.window)
        with ThreadPoolExecutor(min(512, count)) as pool:
            start = time.perf_counter()
            for i in range(count):  # open loop: arrivals on a fixed schedule, whatever the server does
                time.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
                pool.submit(one, stub)
        elapsed = args.window + args.deadline
    return {**outcomes, "goodput": outcomes["ok"] / elapsed}


def print_flood(args, trace_dir: str) -> None:
    policies = args.policies.split(",")
    if not policies or set(policies) - {"fair", "fcfs"}:
        raise SystemExit(f"--policies: fair, fcfs; got {args.policies!r}")
    results = {policy: flood_run(args, policy, trace_dir) for policy in policies}
    print(f"\ntwo tenants: {args.flood_calls} never-read calls x n={args.flood_n}, "
          f"{args.flood_prompt}-token prompts, against {args.requests} interactive requests")
    print(f"{'policy':8} {'ttft p50 alone':>15} {'ttft p99 alone':>15} {'p50 flood':>10} "
          f"{'p99 flood':>10} {'p99 ratio':>10} {'tok/s flood':>12} {'first':>8} {'max of rest':>12} "
          f"{'requests':>9}")
    for name, r in results.items():
        a, f = r["alone"], r["flood"]
        print(f"{name:8} {a['p50'] * 1e3:13.0f}ms {a['p99'] * 1e3:13.0f}ms {f['p50'] * 1e3:8.0f}ms "
              f"{f['p99'] * 1e3:8.0f}ms {f['p99'] / a['p99']:10.2f} {f['tok_s']:12.1f} "
              f"{f['first'] * 1e3:6.0f}ms {f['next_max'] * 1e3:10.0f}ms {f['n']:9d}")
    for name, r in results.items():  # one outlier or many; in the engine or outside; which steps
        f, trace = r["flood"], r["trace"]
        listed = ", ".join(f"#{i} {t * 1e3:.0f}ms ({e * 1e3:.0f})" for i, t, e, _ in f["largest"])
        print(f"\n{name} largest TTFTs under the flood (#request client TTFT (server's)): {listed}")
        for i, t, _, sent in f["largest"]:
            print(f" #{i} {t * 1e3:.0f}ms, the steps from its send to its first token:")
            print("\n".join(waited_on(trace, f"interactive-{i}", sent, sent + t)))
        print(f"{name} steps under the flood by kind (first send to last end):")
        print("\n".join(by_kind(trace, *f["window"])))
    if {"fair", "fcfs"} <= results.keys():
        ratio = results["fair"]["flood"]["tok_s"] / results["fcfs"]["flood"]["tok_s"]
        print(f"throughput fair / fcfs under the flood: {ratio:.3f}")


def main() -> int:
    args = parse_args()
    runs = set(args.runs.split(","))
    if runs - {"flood", "weights", "overload"}:
        raise SystemExit(f"--runs: flood, weights, overload; got {args.runs!r}")
    if "flood" in runs:
        if args.trace_dir is None:
            with tempfile.TemporaryDirectory() as trace_dir:
                print_flood(args, trace_dir)
        else:
            os.makedirs(args.trace_dir, exist_ok=True)
            print_flood(args, args.trace_dir)
    if "weights" in runs:
        tokens = weights_run(args)
        total = sum(tokens.values()) or 1
        print(f"\nweights a=3,b=1 over {args.window:g} s: a {tokens['a']} tokens "
              f"({tokens['a'] / total:.3f}), b {tokens['b']} ({tokens['b'] / total:.3f}); "
              "target 0.750 / 0.250")
    if "overload" in runs:
        print(f"\noverload: {args.rate:g} requests/s for {args.window:g} s, "
              f"deadline {args.deadline:g} s each")
        print(f"{'policy':8} {'finished':>9} {'refused':>8} {'expired':>8} {'other':>6} {'goodput/s':>10}")
        for policy in ("fair", "fcfs"):
            r = overload_run(args, policy)
            print(f"{policy:8} {r['ok']:9d} {r['refused']:8d} {r['expired']:8d} {r['other']:6d} "
                  f"{r['goodput']:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
