"""The serving benchmark's figures: percentiles, one run's summary from its request traces, and
the printed report (``benchmarks/serving/bench.py`` and the concurrency sweep share them)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.benchmarks.serving.load import Trace


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(values)
    return {f"p{q}": s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] for q in (50, 90, 99)}


def summarize(traces: list[Trace], wall_s: float) -> dict:
    ok = [t for t in traces if t.error is None and t.token_times]
    tokens = sum(len(t.token_times) for t in ok)
    ttft = [(t.token_times[0] - t.sent) * 1000 for t in ok]
    itl = [(b - a) * 1000 for t in ok for a, b in zip(t.token_times, t.token_times[1:], strict=False)]
    e2e = [(t.end - t.sent) * 1000 for t in ok]
    return {
        "requests_ok": len(ok),
        "errors": dict(Counter(t.error for t in traces if t.error is not None)),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "ttft_ms": percentiles(ttft),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
    }


def print_report(name: str, r: dict) -> None:
    print(f"\n== {name}")
    print(f"requests ok {r['requests_ok']}, errors {r['errors'] or 'none'}, wall {r['wall_s']:.1f} s")
    print(f"output tokens/s {r['output_tokens_per_s']:.1f}   requests/s {r['requests_per_s']:.2f}")
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        p = r[key]
        print(f"{label:5s} ms  p50 {p['p50']:8.1f}  p90 {p['p90']:8.1f}  p99 {p['p99']:8.1f}")
    if r.get("cpu_s") is not None and r["output_tokens"]:
        per_k = 1000 * r["cpu_s"] / r["output_tokens"]
        r["cpu_s_per_1k_tokens"] = per_k
        print(f"CPU s per 1,000 streamed tokens {per_k:.3f} ({r['cpu_s']:.1f} s in all, {r['cpu_label']})")
    if r.get("load_generator_cpu_s") is not None:
        print(f"load generator (this process, same cores) CPU {r['load_generator_cpu_s']:.1f} s")


def print_ratios(service: dict, local: dict) -> dict:
    ratios = {
        "output_tokens_per_s": service["output_tokens_per_s"] / local["output_tokens_per_s"],
        "ttft_p50": service["ttft_ms"]["p50"] / local["ttft_ms"]["p50"],
        "itl_p50": service["itl_ms"]["p50"] / local["itl_ms"]["p50"],
    }
    print("\n== service / in-process")
    print(f"throughput {ratios['output_tokens_per_s']:.3f}x   TTFT p50 {ratios['ttft_p50']:.3f}x   "
          f"ITL p50 {ratios['itl_p50']:.3f}x")
    return ratios
