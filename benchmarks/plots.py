"""Figures of the benchmarks' JSON results (matplotlib, the ``plot`` or ``dev`` extra), written
as small PNGs.

- ``plot_serving_sweep``: a serving sweep over concurrency levels (benchmarks/serving/bench.py with
  ``--concurrency 1,8,32,128``): output tokens/s, and TTFT / inter-token latency percentiles,
  against concurrency.
- ``plot_offline``: an offline run (benchmarks/offline.py): kvserve's output tokens/s next to
  the peers' and the machine's ceiling for the same workload.

``python -m kvserve.benchmarks.plots RESULT.json OUT.png`` redraws either from its JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

PERCENTILES = ("p50", "p90", "p99")
DPI = 80  # small files: docs/performance/serving.md carries one


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plotting needs matplotlib: pip install 'kvserve[plot]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_serving_sweep(result: dict, path: str) -> None:
    """``result``: {"levels": [c, ...], "service": [summary per level], "workload": str}."""
    plt = _pyplot()
    levels = result["levels"]
    runs = result["service"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=DPI)
    left.plot(levels, [r["output_tokens_per_s"] for r in runs], "o-", color="tab:blue")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="throughput")
    left.set_ylim(bottom=0)
    for key, color, label in (("ttft_ms", "tab:red", "TTFT"), ("itl_ms", "tab:green", "ITL")):
        for pct, style in zip(PERCENTILES, ("-", "--", ":"), strict=True):
            right.plot(levels, [r[key][pct] for r in runs], style, marker="o", color=color,
                       label=f"{label} {pct}")
    right.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="latency")
    right.legend(fontsize=8, ncol=2)
    for ax in (left, right):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvserve serving sweep: {result.get('workload', '')}", fontsize=10)
    _save(fig, path)


def plot_offline(result: dict, path: str) -> None:
    """``result``: benchmarks/offline.py's JSON ({"kvserve": {"output_tok_s"}, optional
    "ceiling" and peers such as "transformers", each with "output_tok_s" or "error")."""
    plt = _pyplot()
    bars = [("kvserve", result["kvserve"]["output_tok_s"], "tab:blue")]
    for name, figures in result.items():
        if name in ("kvserve", "ceiling") or not isinstance(figures, dict) or "output_tok_s" not in figures:
            continue
        label = f"{name} ({figures['mode']})" if figures.get("mode") else name
        bars.append((label, figures["output_tok_s"], "tab:gray"))
    if "output_tok_s" in result.get("ceiling", {}):
        bars.append(("ceiling (matmuls + KV reads)", result["ceiling"]["output_tok_s"], "tab:green"))
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(bars) + 1.2), dpi=DPI)
    names, values, colors = zip(*reversed(bars), strict=True)
    ax.barh(names, values, color=colors)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=9)
    ax.set_xlabel("output tokens/s")
    ax.set_xlim(right=max(values) * 1.15)
    detail = f"{result.get('requests', '?')} requests, {result.get('dtype', '')}"
    ax.set_title(f"kvserve offline throughput ({detail})", fontsize=10)
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_result(result: dict, path: str) -> None:
    """Either figure, by the shape of ``result``."""
    if "levels" in result:
        plot_serving_sweep(result, path)
    elif "kvserve" in result:
        plot_offline(result, path)
    else:
        raise ValueError("result: neither a serving sweep (levels) nor an offline run (kvserve)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.plots",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a benchmark's --json file")
    ap.add_argument("png", help="the figure to write")
    args = ap.parse_args(argv)
    with open(args.result) as f:
        plot_result(json.load(f), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
