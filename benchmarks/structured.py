"""Structured-output cost, for the offline benchmark's ``--json-schema FILE``.

The same requests run twice in one process: constrained by the JSON schema (each request
stops where its JSON is complete, or at its max_tokens), then unconstrained with ``ignore_eos``
and each request's max_tokens set to the number of tokens its constrained run produced, so that
both runs have the same requests, lengths, batches and step count. The difference in time per
engine step is the constraint's cost per step (bitmask filling, masking, matcher updates). The
grammar is compiled before either run; its compile time is printed on its own.
"""

from __future__ import annotations

import time

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.constraints import Constraint
from kvserve.engine.sequence import FinishReason


def run_structured_overhead(llm: LLM, schema: str, prompts, outputs, temperature: float, quiet: bool) -> dict:
    t0 = time.perf_counter()
    llm.engine.structured.compile(Constraint("json_schema", schema))
    compile_s = time.perf_counter() - t0
    constrained = [SamplingParams(temperature=temperature, seed=i, max_tokens=m, json_schema=schema)
                   for i, m in enumerate(outputs)]
    c_time, c_steps, results = _timed(llm, prompts, constrained, quiet)
    produced = [len(r.token_ids) for r in results]
    plain = [SamplingParams(temperature=temperature, seed=i, max_tokens=m, ignore_eos=True)
             for i, m in enumerate(produced)]
    p_time, p_steps, _ = _timed(llm, prompts, plain, quiet)
    complete = sum(r.finish_reason == FinishReason.STOP for r in results)
    c_ms, p_ms = 1000 * c_time / c_steps, 1000 * p_time / p_steps
    print(f"json schema  compile {compile_s * 1000:.1f} ms; {complete}/{len(results)} outputs complete "
          f"(STOP), {sum(produced)} output tokens")
    print(f"constrained  {c_time:8.2f} s  {c_steps} steps  {c_ms:8.2f} ms/step")
    print(f"plain        {p_time:8.2f} s  {p_steps} steps  {p_ms:8.2f} ms/step")
    print(f"structured-output overhead = {c_ms - p_ms:+.2f} ms/step ({(c_ms / p_ms - 1) * 100:+.1f}%)")
    return {"compile_ms": compile_s * 1000, "constrained_ms_per_step": c_ms, "plain_ms_per_step": p_ms}


def _timed(llm: LLM, prompts, params, quiet: bool):
    """(seconds, engine steps, results) of one ``generate`` call."""
    engine = llm.engine
    step = engine.step
    steps = 0

    def counted():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted  # instance attribute: counts this call's steps only
    try:
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=not quiet)
        return time.perf_counter() - t0, steps, results
    finally:
        del engine.step
