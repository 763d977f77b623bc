"""Reading the server's step trace (``--step-trace``, engine/tenancy/step_trace.py) for the tenants
benchmark: which steps an interactive request's first token waited on, and the steps of the window by
kind. Request keys name the tenant (``interactive-7#41``: the client's request_id, then the front-end's
number), so the tenants' hashes are told apart without knowing the server's hashing."""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import defaultdict


class Trace:
    def __init__(self, path: str):
        self.steps: list[dict] = []
        self.firsts: dict[str, dict] = {}  # request key -> its first sequence's first token
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "step" in record and "first" not in record:
                    self.steps.append(record)
                else:
                    self.firsts.setdefault(record["first"], record)
        self.names = {r["tenant"]: key.split("-")[0] for key, r in self.firsts.items()}
        self._starts = [s["start"] for s in self.steps]

    def first_of(self, request_id: str) -> dict | None:
        """The first-token record of the request the client sent as ``request_id``."""
        return next((r for key, r in self.firsts.items() if key.split("#")[0] == request_id), None)

    def between(self, start: float, end: float) -> list[dict]:
        """The steps running at any time in [start, end] (monotonic seconds)."""
        k = max(bisect_right(self._starts, start) - 1, 0)
        out = []
        for step in self.steps[k:]:
            if step["start"] > end:
                break
            if step["end"] >= start:
                out.append(step)
        return out

    def describe(self, step: dict) -> str:
        """One step: its kind, actual (predicted) ms, and per tenant rows run / held and prefill tokens."""
        parts = []
        for tenant, c in sorted(step["tenants"].items(), key=lambda kv: self.names.get(kv[0], kv[0])):
            text = f"{self.names.get(tenant, tenant[:6])} {c['rows']}r"
            text += f"/{c['held']}h" if c["held"] else ""
            text += f" +{c['prefill']}p" if c["prefill"] else ""
            text += f" {c['waiting']}w" if c["waiting"] else ""
            parts.append(text)
        predicted = "?" if step["predicted"] is None else f"{step['predicted'] * 1e3:.0f}"
        extra = f" gap {step['gap'] * 1e3:.0f}ms" if step["gap"] and step["gap"] > 0.005 else ""
        extra += f" gc {step['gc'] * 1e3:.0f}ms" if step["gc"] > 0.001 else ""
        extra += f" preempted {step['preempted']}" if step["preempted"] else ""
        linger = ",".join(f"{self.names.get(t, t[:6])} {s * 1e3:.0f}ms" for t, s in step["linger"].items())
        extra += f" linger {linger}" if linger else ""
        return (f"step {step['step']} {step['kind']} {step['actual'] * 1e3:.0f}ms (model {predicted}) "
                f"[{'; '.join(parts)}]{extra}")

    def fit(self, step: dict) -> str:
        if step["coef"] is None:
            return "no fit"
        c0, a, b = step["coef"]
        return f"fit c0 {c0 * 1e3:.1f}ms a {a * 1e3:.3f}ms/token b {b * 1e6:.2f}us/pair"


def waited_on(trace: Trace, request_id: str, sent: float, first: float) -> list[str]:
    """Lines for one request: where the engine took it, then every step from its send to its first
    token on the client's (and the server's) monotonic clock."""
    record = trace.first_of(request_id)
    head = "  not in the trace"
    if record is not None:
        head = (f"  engine took it {(record['arrived'] - sent) * 1e3:.0f}ms after the send, after step "
                f"{record['after']}; admitted in step {record['admitted']}, first token in {record['step']}")
    steps = trace.between(sent, first)
    lines = [head] + [f"    {trace.describe(s)}" for s in steps]
    if steps:
        lines.append(f"    ({trace.fit(steps[0])} at the first of these)")
    return lines


def by_kind(trace: Trace, start: float, end: float) -> list[str]:
    """The window's steps per kind: how many, their mean actual and predicted ms, the share of the time."""
    kinds: dict[str, list[dict]] = defaultdict(list)
    for step in trace.between(start, end):
        kinds[step["kind"]].append(step)
    total = sum(s["actual"] for steps in kinds.values() for s in steps) or 1.0
    lines = []
    for kind, steps in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        actual = sum(s["actual"] for s in steps) / len(steps)
        known = [s["predicted"] for s in steps if s["predicted"] is not None]
        predicted = f"{sum(known) / len(known) * 1e3:.0f}" if known else "?"
        worst, share = max(s["actual"] for s in steps), sum(s["actual"] for s in steps) / total
        lines.append(f"  {kind:9} {len(steps):6d} steps, mean {actual * 1e3:.0f}ms (model {predicted}), "
                     f"max {worst * 1e3:.0f}ms, {share:.0%} of the step time")
    gaps = [s["gap"] for s in trace.between(start, end) if s["gap"] is not None]
    if gaps:
        mean = sum(gaps) / len(gaps)
        lines.append(f"  between steps: {mean * 1e3:.1f}ms mean, max {max(gaps) * 1e3:.0f}ms")
    return lines
