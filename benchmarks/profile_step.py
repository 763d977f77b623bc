"""Where one step's time goes: a decode step and a prefill chunk next to their matmul-only time.

Decode: ``--batch`` requests with prompts of ``--context`` random tokens are prefilled, then
``--rounds`` rounds of ``--steps`` decode steps are timed (the whole ``LLMEngine.step``:
scheduling, inputs, forward, sampling at ``--temperature``), split into the model forward and the
sampler, each round followed by the time of the same batch's weight multiplications alone
(``benchmarks/instruments/ceiling.py``). Interleaved, both see the same load on a shared machine; the fastest
round of each is kept.

Prefill: prompts of ``--context`` tokens with ``max_tokens=1``, so every step is a prefill chunk
of a full token budget; prompt tokens/s next to the matmul rate at that many rows, interleaved
the same way.

``--host-profile`` measures instead the host work of a decode step, as CPU time of the stepping
thread (robust on a shared machine): everything ``LLMEngine.step`` does besides the model's forward
pass and LM head (scheduling, block tables, input building, attention planning, sampling, output
handling, detokenization), plus encoding the step's outputs as the core's ``StepDone`` message, split
by stage; ``--core`` steps as the engine-core process does, leaving detokenization to the front-end;
``--cprofile N`` also prints the N costliest functions of those steps. With ``--threads 1`` the
thread's CPU time holds all of the step's work. On the tiny model at batch 256 the greedy sampler's
share is mostly one argmax over [256, vocab] logits: a kernel, device work on a GPU.

    python -m kvserve.benchmarks.profile_step --model DIR --dtype float32 --batch 256 --context 200 \
        --context-spread 100 --steps 50 --temperature 0 --threads 1 --host-profile [--core]

``--fused-ab`` times only decode steps at ``--batch`` with the fused decode step
(engine/models/decode_row.py) and with the per-op path, in alternating rounds, and prints the
median round of each (above 8 sequences the fused step needs csrc/gemm.c's packed weights).

``--gemm-ab`` does the same on the per-op path with the projections through csrc/gemm.c's packed
weights (as the engine loads them) and through oneDNN's packed copies of the same weights
(``--batch`` above 8: fewer rows multiply in linear.c's row kernel).

``--compete N`` then times the decode steps again with N busy processes (a pure-Python loop
each) running beside the engine: on a shared CPU a step should slow down no more than in
proportion to the CPU they take. What they take is measured (their scheduled CPU time from
``/proc/PID/schedstat`` over each timed round): with ``c`` CPUs and ``b`` CPUs' worth taken, a
step that uses every CPU alone is left ``c - b`` of them, so the proportional slowdown is
``c / (c - b)``. The fair-share figure ``(threads + N) / threads`` is printed beside it.

    python -m kvserve.benchmarks.profile_step [--batch 48] [--context 300] [--temperature 0.6] [--rounds 4]
        [--torch-profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from typing import NamedTuple

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments import engine_steps
from kvserve.benchmarks.instruments.ceiling import MatmulCeiling
from kvserve.benchmarks.instruments.engine_steps import (
    Timed,
    abort_all,
    patched,
    prefill_batch,
    random_prompts,
)
from kvserve.benchmarks.instruments.procfs import scheduled_cpu_s
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import KV_CACHE_DTYPES
from kvserve.engine.model_loader.loader import load_hf_config
from kvserve.engine.process.threads import available_cpus


class _Round(NamedTuple):
    """One timed round of decode steps (per step, seconds) and the CPUs' worth used while it ran."""

    step_s: float
    forward_s: float
    sampler_s: float
    matmul_s: float  # the same batch's matmuls alone, right after (nan without a ceiling)
    plain_matmul_s: float  # the same with plain weights through F.linear (nan without blocked weights)
    busy_cpus: float  # taken by the busy processes
    cpus_used: float  # by this process


def profile_decode(llm: LLM, args, ceiling: MatmulCeiling | None, busy_pids: list[int] = (),
                   plain: MatmulCeiling | None = None) -> dict:
    """Decode steps timed in ``args.rounds`` rounds of ``args.steps``, each round followed by the
    matmul-only time of the same batch (unless ``ceiling`` is None): on a shared machine both see
    the same load, and the figures kept are each one's fastest round (as ``best_time`` keeps the
    fastest run). With ``busy_pids``, each round also records the CPUs' worth those processes took
    while it ran; the figure kept is the fastest round's. ``plain``, where given, times the same
    matmuls with plain weights through ``F.linear`` after each round too."""
    eng = llm.engine
    max_tokens = args.rounds * args.steps + 8
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
    prefill_batch(eng, args, params, "decode")
    rounds = []
    with patched(eng.executor, "execute_model", Timed(eng.executor.execute_model)) as forward, \
            patched(eng, "sampler", Timed(eng.sampler)) as sampler:
        eng.step()  # warm-up at this shape
        profiler = _profiler(args)
        with profiler:
            for _ in range(args.rounds):
                forward.seconds = sampler.seconds = 0.0
                busy0, own0 = scheduled_cpu_s(busy_pids), time.process_time()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                wall_s = time.perf_counter() - t0
                own_cpus = (time.process_time() - own0) / wall_s
                busy_cpus = (scheduled_cpu_s(busy_pids) - busy0) / wall_s
                matmul_s, plain_s = (c.measure_decode_step(args.batch) if c is not None else float("nan")
                                     for c in (ceiling, plain))
                per_step = 1 / args.steps
                rounds.append(_Round(wall_s * per_step, forward.seconds * per_step,
                                     sampler.seconds * per_step, matmul_s, plain_s, busy_cpus, own_cpus))
    abort_all(eng)
    _print_profile(profiler, args)
    best = min(rounds)  # the fastest step
    return {"batch": args.batch, "context": args.context, "step_ms": best.step_s * 1e3,
            "forward_ms": best.forward_s * 1e3, "sampler_ms": best.sampler_s * 1e3,
            "matmul_ms": min(r.matmul_s for r in rounds) * 1e3,
            "plain_matmul_ms": min(r.plain_matmul_s for r in rounds) * 1e3,
            "cpus_used": best.cpus_used, "busy_cpus": best.busy_cpus,
            "rounds_busy_cpus": [round(r.busy_cpus, 3) for r in rounds],
            "rounds_step_ms": [round(r.step_s * 1e3, 2) for r in rounds],
            "rounds_matmul_ms": [round(r.matmul_s * 1e3, 2) for r in rounds]}


def profile_prefill(llm: LLM, args, ceiling: MatmulCeiling) -> dict:
    """Full-budget prefill chunks (prompts of ``args.context`` tokens, one output token each),
    one ``generate`` per chunk's worth of prompts, each followed by the matmul-only time of a
    full budget; the fastest of each is kept."""
    budget = llm.engine.config.max_num_batched_tokens
    per_chunk = max(1, budget // args.context)
    vocab = min(10000, llm.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(random_prompts(1, args.context, vocab, args.seed + 1), params, use_tqdm=False)  # warm-up
    rates, matmul_rates = [], []
    for chunk in range(args.prefill_chunks):
        prompts = random_prompts(per_chunk, args.context, vocab, args.seed + 2 + chunk)  # nothing cached
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(per_chunk * args.context / (time.perf_counter() - t0))
        matmul_rates.append(budget / ceiling.measure_layers(budget))
    return {"prompt_tokens": per_chunk * args.context, "tokens_per_s": max(rates), "token_budget": budget,
            "matmul_tokens_per_s": max(matmul_rates)}


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes that each keep one CPU busy until the block ends; yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # let them start spinning
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _profiler(args):
    if not args.torch_profile:
        return torch.autograd.profiler.record_function("steps")  # a no-op context outside a profile
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _print_profile(profiler, args) -> None:
    if args.torch_profile:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    ap.add_argument("--context-spread", type=int, default=0, help="prompts of context ± this many tokens")
    ap.add_argument("--steps", type=int, default=5,
                    help="decode steps per timed round (with --host-profile: steps timed)")
    ap.add_argument("--rounds", type=int, default=4,
                    help="timed rounds, each followed by the matmul-only time")
    ap.add_argument("--prefill-chunks", type=int, default=4, help="full-budget prefill chunks timed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the engine's)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the KV cache: auto = the model's dtype, int8 = int8 rows with scales (CPU)")
    ap.add_argument("--compete", type=int, default=0, help="also time decode beside N busy processes")
    ap.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top ops")
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--host-profile", action="store_true",
                    help="only measure the host CPU time of a decode step besides the forward pass")
    ap.add_argument("--core", action="store_true",
                    help="with --host-profile: step as the engine-core process does, without detokenizing")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="with --host-profile: print cProfile's N costliest functions")
    ap.add_argument("--fused-ab", action="store_true",
                    help="only time decode steps with the fused decode step (engine/models/decode_row.py) "
                         "and without it, in alternating rounds")
    ap.add_argument("--gemm-ab", action="store_true",
                    help="only time decode steps with the projections through csrc/gemm.c and through "
                         "oneDNN's packed weights on the per-op path, in alternating rounds "
                         "(--batch above 8)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)

    options = {"threads": args.threads} if args.threads else {}
    if args.quantization:
        options["quantization"] = args.quantization
    options["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch, 1),
              max_num_batched_tokens=max(args.max_num_batched_tokens, args.batch),
              enforce_eager=args.enforce_eager, **options)
    if args.host_profile:
        return engine_steps.host_main(llm, args)
    if args.fused_ab or args.gemm_ab:
        return engine_steps.ab_main(llm, args)
    try:
        dtype = llm.engine.executor.dtype
        hf_config, device = load_hf_config(llm.engine.source), llm.engine.executor.device
        ceiling = MatmulCeiling(hf_config, dtype, device)
        plain = MatmulCeiling(hf_config, dtype, device, plain=True) if ceiling.blocked else None
        decode = profile_decode(llm, args, ceiling, plain=plain)
        del plain
        prefill = profile_prefill(llm, args, ceiling)
        if args.compete:
            args.torch_profile = False
            with busy_processes(args.compete) as pids:
                beside = profile_decode(llm, args, None, pids)
            decode.update(step_ms_beside_busy=beside["step_ms"],
                          rounds_step_ms_beside_busy=beside["rounds_step_ms"], busy_processes=args.compete,
                          busy_cpus=beside["busy_cpus"], rounds_busy_cpus=beside["rounds_busy_cpus"],
                          cpus_used_beside_busy=beside["cpus_used"], cpus=available_cpus())
    finally:
        llm.shutdown()
    decode["step_over_matmul"] = decode["step_ms"] / decode["matmul_ms"]
    decode["step_over_plain_matmul"] = decode["step_ms"] / decode["plain_matmul_ms"]
    decode["sampler_share"] = decode["sampler_ms"] / decode["step_ms"]
    prefill["share_of_matmul_rate"] = prefill["tokens_per_s"] / prefill["matmul_tokens_per_s"]
    result = {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "decode": decode, "prefill": prefill}
    _print_result(result)
    write_json(args.json, result)
    return result


def _print_result(r: dict) -> None:
    d, p = r["decode"], r["prefill"]
    print(f"dtype={r['dtype']} threads={r['threads']}")
    print(f"decode step, batch {d['batch']}, {d['context']}-token contexts: {d['step_ms']:.1f} ms "
          f"(forward {d['forward_ms']:.1f} ms, sampler {d['sampler_ms']:.1f} ms = {d['sampler_share']:.0%}); "
          f"matmul-only {d['matmul_ms']:.1f} ms; step / matmul = {d['step_over_matmul']:.2f}x")
    if d["plain_matmul_ms"] == d["plain_matmul_ms"]:  # not nan: the engine's weights are blocked
        print(f"  (the same matmuls with plain weights through F.linear: {d['plain_matmul_ms']:.1f} ms; "
              f"step / that = {d['step_over_plain_matmul']:.2f}x)")
    if "step_ms_beside_busy" in d:
        n, threads, cpus, taken = d["busy_processes"], r["threads"], d["cpus"], d["busy_cpus"]
        used, used_beside = d["cpus_used"], d["cpus_used_beside_busy"]
        left = cpus - taken
        proportional = used / min(used, left) if left > 0 else float("inf")
        print(f"decode step beside {n} busy process(es): {d['step_ms_beside_busy']:.1f} ms = "
              f"{d['step_ms_beside_busy'] / d['step_ms']:.2f}x alone. Alone the engine kept {used:.2f} "
              f"CPUs busy ({used * d['step_ms']:.0f} CPU-ms per step); they took {taken:.2f} of {cpus}, "
              f"leaving {left:.2f}, so in proportion to the CPU taken: {proportional:.2f}x. Beside them "
              f"the engine used {used_beside:.2f} CPUs ({used_beside * d['step_ms_beside_busy']:.0f} "
              f"CPU-ms per step); a fair share among {threads + n} threads would be "
              f"{(threads + n) / threads:.2f}x")
    print(f"prefill, chunks of {p['token_budget']} tokens: {p['tokens_per_s']:.0f} tokens/s; "
          f"matmul rate {p['matmul_tokens_per_s']:.0f} tokens/s; {p['share_of_matmul_rate']:.0%} of it")


if __name__ == "__main__":
    main()
