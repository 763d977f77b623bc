"""Structured-output cost, for the offline benchmark's ``--json-schema FILE``.

The same requests run constrained by the JSON schema (each request stops where its JSON is
complete, or at its max_tokens) and unconstrained with ``ignore_eos`` and each request's
max_tokens set to the number of tokens its constrained run produced, so that both runs have the
same requests, lengths, batches and step count. Two rounds alternate the two runs, and each
kind's best time per engine step is compared (the best is the one least disturbed by other
work on a shared machine). The time spent in the structured-output hooks themselves (bitmask
filling, masking, matcher updates) is also timed directly, per step. The grammar is compiled
before any run; its compile time is printed on its own.
"""

from __future__ import annotations

import time

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.constraints import Constraint
from kvserve.engine.sequence import FinishReason

ROUNDS = 2


def run_structured_overhead(llm: LLM, schema: str, prompts, outputs, temperature: float, quiet: bool) -> dict:
    t0 = time.perf_counter()
    llm.engine.structured.compile(Constraint("json_schema", schema))
    compile_s = time.perf_counter() - t0
    constrained = [SamplingParams(temperature=temperature, seed=i, max_tokens=m, json_schema=schema)
                   for i, m in enumerate(outputs)]
    c_runs, p_runs, results = [], [], None
    for _ in range(ROUNDS):
        run, results = _timed(llm, prompts, constrained, quiet)
        c_runs.append(run)
        plain = [SamplingParams(temperature=temperature, seed=i, max_tokens=len(r.token_ids), ignore_eos=True)
                 for i, r in enumerate(results)]
        p_runs.append(_timed(llm, prompts, plain, quiet)[0])
    c, p = min(c_runs, key=lambda r: r.ms_per_step), min(p_runs, key=lambda r: r.ms_per_step)
    complete = sum(r.finish_reason == FinishReason.STOP for r in results)
    print(f"json schema  compile {compile_s * 1000:.1f} ms; {complete}/{len(results)} outputs complete "
          f"(STOP), {sum(len(r.token_ids) for r in results)} output tokens")
    print(f"constrained  {c.seconds:8.2f} s  {c.steps} steps  {c.ms_per_step:8.2f} ms/step  "
          f"(of which {c.hook_ms_per_step:.2f} ms/step in the structured-output hooks)")
    print(f"plain        {p.seconds:8.2f} s  {p.steps} steps  {p.ms_per_step:8.2f} ms/step")
    print(f"structured-output overhead = {c.ms_per_step - p.ms_per_step:+.2f} ms/step "
          f"({(c.ms_per_step / p.ms_per_step - 1) * 100:+.1f}%); best of {ROUNDS} alternating rounds each")
    return {"compile_ms": compile_s * 1000, "constrained_ms_per_step": c.ms_per_step,
            "plain_ms_per_step": p.ms_per_step, "hook_ms_per_step": c.hook_ms_per_step}


class _Run:
    def __init__(self, seconds: float, steps: int, hook_seconds: float):
        self.seconds, self.steps = seconds, steps
        self.ms_per_step = 1000 * seconds / steps
        self.hook_ms_per_step = 1000 * hook_seconds / steps


def _timed(llm: LLM, prompts, params, quiet: bool) -> tuple[_Run, list]:
    """One ``generate`` call: its time, engine steps and time inside the structured-output hooks
    (counted through instance attributes that shadow the methods for this call only)."""
    engine, structured = llm.engine, llm.engine.structured
    counts = {"steps": 0, "hook_s": 0.0}

    def counting(fn):
        def wrapper(*args):
            counts["steps"] += 1
            return fn(*args)
        return wrapper

    def timing(fn):
        def wrapper(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                counts["hook_s"] += time.perf_counter() - t
        return wrapper

    engine.step = counting(engine.step)
    structured.mask_logits, structured.advance = timing(structured.mask_logits), timing(structured.advance)
    try:
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=not quiet)
        return _Run(time.perf_counter() - t0, counts["steps"], counts["hook_s"]), results
    finally:
        del engine.step, structured.mask_logits, structured.advance
