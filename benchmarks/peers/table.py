"""The peers' comparison as the harness prints and draws it: one row per system and load level
(output tokens/s, TTFT p50/p99, inter-token latency p50/p99, errors), kvserve's ratios to each
peer per level, and the goodput figure (``--plot``: output tokens/s against TTFT p99, one line
per system, each point labelled with its load). The figures themselves come from the serving
benchmark's ``summarize``.
"""

from __future__ import annotations

import math
import statistics

HEADER = (f"{'system':10s} {'load':>8s} {'tok/s':>9s} {'TTFT p50':>10s} {'TTFT p99':>10s} "
          f"{'ITL p50':>9s} {'ITL p99':>9s} {'ok':>5s}  errors")
RATIO_HEADER = f"{'load':>8s} {'throughput':>11s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>9s}"


def level_label(level: dict) -> str:
    """``c=8`` for a closed loop of 8 clients, ``2/s`` for Poisson arrivals at 2 requests/s."""
    return f"c={level['value']}" if level["kind"] == "concurrency" else f"{level['value']:g}/s"


def row(system: str, level: dict, r: dict) -> str:
    """One system at one level; ms for the latencies."""
    errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "-"
    return (f"{system:10s} {level_label(level):>8s} {r['output_tokens_per_s']:9.1f} "
            f"{r['ttft_ms']['p50']:10.1f} {r['ttft_ms']['p99']:10.1f} "
            f"{r['itl_ms']['p50']:9.1f} {r['itl_ms']['p99']:9.1f} {r['requests_ok']:5d}  {errors}")


def print_table(result: dict) -> None:
    print(f"\n== results: {result['workload']} (latencies in ms)")
    print(HEADER)
    for system, runs in result["systems"].items():
        if "error" in runs:
            print(f"{system:10s} failed: {runs['error']}")
            continue
        for level, r in zip(result["levels"], runs["levels"], strict=True):
            print(row(system, level, r))


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def ratios(kvserve: list[dict], peer: list[dict]) -> list[dict]:
    """kvserve / peer at each level: above 1 is better for throughput, below 1 for latencies."""
    return [{"output_tokens_per_s": _ratio(k["output_tokens_per_s"], p["output_tokens_per_s"]),
             "ttft_p50": _ratio(k["ttft_ms"]["p50"], p["ttft_ms"]["p50"]),
             "ttft_p99": _ratio(k["ttft_ms"]["p99"], p["ttft_ms"]["p99"]),
             "itl_p50": _ratio(k["itl_ms"]["p50"], p["itl_ms"]["p50"])}
            for k, p in zip(kvserve, peer, strict=True)]


def print_ratios(result: dict) -> dict:
    """kvserve's ratio to each peer that ran, per level; the same as a dict (peer -> per level)."""
    systems = result["systems"]
    out = {}
    if "levels" not in systems.get("kvserve", {}):
        return out
    for peer, runs in systems.items():
        if peer == "kvserve" or "levels" not in runs:
            continue
        out[peer] = ratios(systems["kvserve"]["levels"], runs["levels"])
        print(f"\n== kvserve / {peer} (throughput: higher is better for kvserve; latencies: lower)")
        print(RATIO_HEADER)
        for level, r in zip(result["levels"], out[peer], strict=True):
            print(f"{level_label(level):>8s} {r['output_tokens_per_s']:10.2f}x {r['ttft_p50']:8.2f}x "
                  f"{r['ttft_p99']:8.2f}x {r['itl_p50']:8.2f}x")
    return out


def median_ratios(rounds: list[dict]) -> dict:
    """Per peer that ran in every round, per level and ratio: the median over the rounds and the
    range, as {"median": m, "low": lo, "high": hi} (NaN rounds left out)."""
    out = {}
    for peer in (rounds[0] if rounds else {}):
        if not all(peer in r for r in rounds):
            continue
        out[peer] = []
        for at in range(len(rounds[0][peer])):
            level = {}
            for key in rounds[0][peer][at]:
                values = sorted(v for r in rounds if not math.isnan(v := r[peer][at][key]))
                if not values:
                    level[key] = {"median": float("nan"), "low": float("nan"), "high": float("nan")}
                    continue
                level[key] = {"median": statistics.median(values), "low": values[0], "high": values[-1]}
            out[peer].append(level)
    return out


def print_median_ratios(levels: list[dict], rounds: list[dict]) -> dict:
    """``median_ratios`` printed, median (low-high) per level and peer; returned too."""
    out = median_ratios(rounds)
    for peer, per_level in out.items():
        print(f"\n== kvserve / {peer}, median of {len(rounds)} rounds (low-high)")
        print(f"{'load':>8s} {'throughput':>19s} {'TTFT p50':>19s} {'TTFT p99':>19s} {'ITL p50':>19s}")
        for level, r in zip(levels, per_level, strict=True):
            cells = [f"{r[k]['median']:.2f}x ({r[k]['low']:.2f}-{r[k]['high']:.2f})"
                     for k in ("output_tokens_per_s", "ttft_p50", "ttft_p99", "itl_p50")]
            print(f"{level_label(level):>8s} " + " ".join(f"{c:>19s}" for c in cells))
    return out


COLORS = {"kvserve": "tab:blue", "vllm": "tab:orange", "llama.cpp": "tab:green"}


def plot_goodput(result: dict, path: str) -> None:
    """Output tokens/s (y) against TTFT p99 (x, log): a solid line through each system's closed-loop
    levels, a dotted one through its Poisson rates; up and to the left is better."""
    from kvserve.benchmarks.plots import DPI, _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=DPI)
    for system, runs in result["systems"].items():
        if "levels" not in runs:
            continue
        color = COLORS.get(system, "tab:gray")
        for kind, style in (("concurrency", "o-"), ("rate", "s:")):
            points = [(r["ttft_ms"]["p99"], r["output_tokens_per_s"], level_label(lv))
                      for lv, r in zip(result["levels"], runs["levels"], strict=True)
                      if lv["kind"] == kind and r["requests_ok"]]
            if not points:
                continue
            xs, ys, labels = zip(*points, strict=True)
            label = system if kind == "concurrency" else f"{system} (Poisson rate)"
            ax.plot(xs, ys, style, color=color, label=label)
            for x, y, text in points:
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    ax.set(xscale="log", xlabel="TTFT p99 (ms)", ylabel="output tokens/s")
    plain = plt.FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2x10^1
    ax.xaxis.set_major_formatter(plain)
    # minor labels only at 2x and 5x a decade: every minor tick labelled runs them together
    ax.xaxis.set_minor_formatter(plt.FuncFormatter(
        lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.margins(x=0.08, y=0.12)  # room for the labels
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"goodput: {result['workload']}", fontsize=9)
    _save(fig, path)
