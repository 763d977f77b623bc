"""What the step time bound costs a large model, in process (``python -m
kvserve.benchmarks.scale.step_bound --model FILE``; e.g. the scale harness's SmolLM2-1.7B Q4_K_M file):
the peers harness's burst (``--requests`` prompts of ``--prompt-len`` random tokens, ``--output-len``
new tokens each, all at once, temperature 0.6) through one engine's steps, once per arm, the arms
taking turns round by round so that on a shared machine they see the same load. An arm is
``BOUND/BUDGET[/SHARE]``: the step time bound in ms (0: none), the step's token budget, and the
scheduler's fixed-part share (``step_time.FIXED_SHARE``; 0: no fixed-part floor, main's rule before
it). Each arm keeps its own step time model across rounds, as a server keeps one across requests.

Per arm and round: the whole burst's seconds and generated tokens per second, steps, the prefill
chunks the scheduler chose, TTFT p50 and the gaps between a request's tokens (ITL p50, p99) while
other prompts prefilled. ``--split`` adds where the steps' wall time went: the projections (every
``LinearBase``), attention, norms, the LM head, the sampler, the rest of the forward (embedding,
rotary, activation, Python), and the engine around the model (scheduling, inputs, outputs), for
the steps with a prompt chunk and for the decode-only steps apart.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.engine_steps import Timed, patched
from kvserve.benchmarks.serving.load import make_workload
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.core import step_time
from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.core.step_time import StepTimeModel, attended_pairs
from kvserve.engine.layers.attention.backend import Attention
from kvserve.engine.layers.embed_head import ParallelLMHead
from kvserve.engine.layers.linear import LinearBase
from kvserve.engine.layers.norm import RMSNorm
from kvserve.engine.sequence import Sequence

PARTS = ((LinearBase, "projections"), (Attention, "attention"), (RMSNorm, "norms"),
         (ParallelLMHead, "lm head"))


def parse_arm(text: str) -> tuple[float, int, float]:
    fields = text.split("/")
    try:
        bound, budget = float(fields[0]), int(fields[1])
        share = float(fields[2]) if len(fields) > 2 else step_time.FIXED_SHARE
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"an arm is BOUND_MS/BUDGET[/SHARE], got {text!r}") from None
    if len(fields) > 3 or bound < 0 or budget < 1 or not 0 <= share < 1:
        raise argparse.ArgumentTypeError(f"an arm is BOUND_MS/BUDGET[/SHARE] (bound >= 0, budget >= 1, "
                                         f"0 <= share < 1), got {text!r}")
    return bound, budget, share


class PartClock:
    """Wall seconds inside each part's modules (forward hooks), added up until ``take``."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self._open: dict[int, float] = {}
        self.handles = []
        for module in model.modules():
            part = next((name for cls, name in PARTS if isinstance(module, cls)), None)
            if part is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave(part)))

    def _enter(self, module, args):
        self._open[id(module)] = time.perf_counter()

    def _leave(self, part: str):
        def hook(module, args, output):
            self.seconds[part] += time.perf_counter() - self._open.pop(id(module))
        return hook

    def take(self) -> dict[str, float]:
        got, self.seconds = dict(self.seconds), defaultdict(float)
        return got

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_burst(eng, work, params, tag: str, clock: PartClock | None) -> dict:
    """Every request of ``work`` added at once, then steps until all are done; per step its wall
    time, decode rows, prefill chunks and (with ``clock``) its parts."""
    seqs = []
    for i, req in enumerate(work):
        rid = f"{tag}-{i}"
        eng.add_request(rid, req.prompt, SamplingParams(**params, max_tokens=req.max_tokens))
        seqs.append(eng.requests[rid].seq)
    steps, first, stamps = [], {}, defaultdict(list)
    counts = [0] * len(seqs)
    with contextlib.ExitStack() as stack:
        timers = {"forward": (eng.executor, "execute_model"), "sampler": (eng, "sampler"),
                  "schedule": (eng.scheduler, "schedule")}
        timers = {k: stack.enter_context(patched(obj, attr, Timed(getattr(obj, attr))))
                  for k, (obj, attr) in timers.items()}
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            before = [s.num_computed_tokens for s in seqs]
            was = {k: t.seconds for k, t in timers.items()}
            coef = eng.scheduler.step_time.coef if eng.scheduler.step_time else None
            t0 = time.perf_counter()
            eng.step()
            now = time.perf_counter()
            step = {"seconds": now - t0, "decode": 0, "chunks": [], "coef": coef, "pairs": 0}
            for i, s in enumerate(seqs):
                done = s.num_computed_tokens - before[i]
                step["pairs"] += attended_pairs(before[i], done)
                got = s.num_completion_tokens - counts[i]
                if done > 1 or (done == 1 and not got):
                    step["chunks"].append(done)  # a prompt's chunk (its last one samples too)
                elif got:
                    step["decode"] += 1
                if got:
                    counts[i] = s.num_completion_tokens
                    first.setdefault(i, now - start)
                    stamps[i].append(now)
            for k, t in timers.items():
                step[k] = t.seconds - was[k]
            if clock is not None:
                step["parts"] = clock.take()
            steps.append(step)
    total = time.perf_counter() - start
    return summarize(steps, total, first, stamps, sum(counts))


def summarize(steps, total, first, stamps, generated) -> dict:
    chunks = [c for s in steps for c in s["chunks"]]
    prefill_steps = [s for s in steps if s["chunks"]]
    gaps = sorted(b - a for ts in stamps.values() for a, b in zip(ts, ts[1:], strict=False))
    ttft = sorted(first.values())
    out = {"seconds": total, "tok_s": generated / total, "steps": len(steps),
           "prefill_steps": len(prefill_steps),
           "chunks": len(chunks), "chunk_p50": statistics.median(chunks) if chunks else 0,
           "chunk_min": min(chunks, default=0), "chunk_max": max(chunks, default=0),
           "prefill_step_p50_s": statistics.median([s["seconds"] for s in prefill_steps] or [0]),
           "ttft_p50_s": ttft[len(ttft) // 2], "itl_p50_s": gaps[len(gaps) // 2] if gaps else 0,
           "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0}
    out["prefill_steps_split_s"] = split_parts(prefill_steps)
    out["decode_steps_split_s"] = split_parts([s for s in steps if not s["chunks"]])
    out["steps_seen"] = [[s["decode"], s["chunks"], s["pairs"], round(s["seconds"], 4)] for s in steps]
    fits = [s["coef"] for s in prefill_steps if s["coef"]]
    out["fit_p50"] = [statistics.median(c[i] for c in fits) for i in range(3)] if fits else None
    return out


def split_parts(steps) -> dict[str, float]:
    """Where ``steps``' wall time went: the timers' parts and, with ``--split``, the forward's."""
    split = defaultdict(float)
    for s in steps:
        split["sampler"] += s["sampler"]
        split["scheduler"] += s["schedule"]
        split["engine around the model"] += s["seconds"] - s["forward"] - s["sampler"] - s["schedule"]
        inside = s.get("parts")
        if inside is not None:
            for part, sec in inside.items():
                split[part] += sec
            split["rest of the forward"] += s["forward"] - sum(inside.values())
        else:
            split["forward"] += s["forward"]
    return dict(split)


def simulate(machine: tuple[float, float, float], work, arm) -> dict:
    """The same burst through the real scheduler on a synthetic machine (``c0 + a * tokens + b * pairs``
    seconds a step, model seconds: no model, no wall clock), its step time model trained on that
    machine first (a server's is, by the requests before): total seconds, steps, TTFT p50, gaps."""
    c0, a, b = machine
    bound, budget, share = arm
    sched = Scheduler(BlockManager(8192, 16, False), len(work), budget, 4096, [0], max_step_time=bound / 1000)
    for tokens, pos in [(1, 300), (64, 0), (200, 100), (1, 100)] * 10:
        if sched.step_time:
            pairs = attended_pairs(pos, tokens)
            sched.step_time.observe(tokens, pairs, c0 + a * tokens + b * pairs)
    seqs = [Sequence(f"sim-{i}", w.prompt, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
            for i, w in enumerate(work)]
    for seq in seqs:
        sched.add(seq)
    now, steps, first, stamps, kept = 0.0, [], {}, defaultdict(list), step_time.FIXED_SHARE
    step_time.FIXED_SHARE = share
    try:
        while sched.has_unfinished():
            out = sched.schedule()
            chunks = [x.num_tokens for x in out.scheduled if x.seq.num_completion_tokens == 0]
            pairs = out.attended_pairs
            seconds = c0 + a * out.num_tokens + b * pairs
            sched.postprocess(out, [7] * len(out.sampling_seqs))
            if sched.step_time:
                sched.step_time.observe(out.num_tokens, pairs, seconds)
            now += seconds
            for seq in out.sampling_seqs:
                first.setdefault(seq.seq_id, now)
                stamps[seq.seq_id].append(now)
            steps.append({"seconds": seconds, "chunks": chunks, "decode": len(out.scheduled) - len(chunks),
                          "forward": seconds, "sampler": 0.0, "schedule": 0.0, "coef": None, "pairs": pairs})
    finally:
        step_time.FIXED_SHARE = kept
    return summarize(steps, now, first, stamps, sum(len(v) for v in stamps.values()))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.step_bound",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model file or directory (e.g. model-Q4_K_M.gguf; not with --simulate)")
    ap.add_argument("--arms", type=lambda t: [parse_arm(a) for a in t.split(",")],
                    default=[(500.0, 2048, 0.0), (500.0, 2048, step_time.FIXED_SHARE), (0.0, 2048, 0.0)],
                    help="BOUND_MS/BUDGET[/SHARE],...: 500/2048/0 is main's served default before the "
                    "fixed-part floor, 500/2048 today's")
    ap.add_argument("--dtype", default="auto", help="the engine's (bfloat16 for an HF checkpoint)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", default="64:400", metavar="LO:HI")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1, help="the workload's (the harness's level 2 of 1,16: 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--split", action="store_true", help="time the forward's parts (module hooks)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--simulate", metavar="C0,A,B", help="no model: the arms through the scheduler on a "
                    "synthetic machine of C0 s a step, A s a token and B s an attended pair (model seconds)")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))
    work = make_workload(SimpleNamespace(token_range=(1000, 30000), prompt_len=(lo, hi), shared_prefix=0.0,
                                         request_rate=None, num_requests=args.requests,
                                         output_len=(args.output_len, args.output_len)), seed=args.seed)
    if args.simulate:
        machine = tuple(float(x) for x in args.simulate.split(","))
        if len(machine) != 3 or min(machine) < 0:
            raise SystemExit(f"--simulate is C0,A,B, three seconds >= 0, got {args.simulate!r}")
        results = {arm: [simulate(machine, work, arm)] for arm in args.arms}
        for arm, (got,) in results.items():
            print(f"arm {fmt(arm)} (model seconds): {line(got)}")
        return results
    if not args.model:
        raise SystemExit("--model is required (or --simulate C0,A,B)")
    budget = max(b for _, b, _ in args.arms)
    llm = LLM(args.model, max_num_seqs=max(16, args.requests), max_num_batched_tokens=budget,
              max_step_time_ms=0, enable_prefix_caching=False, dtype=args.dtype)
    eng, sched = llm.engine, llm.engine.scheduler
    params = {"temperature": 0.6, "ignore_eos": True}
    clock = PartClock(eng.executor.model) if args.split else None
    # one step time model per bound, trained across the arms' bursts (a server keeps one), and first
    # by a warm-up burst of a few requests
    bounds = {bound: StepTimeModel(bound / 1000) for bound, _, _ in args.arms if bound}
    models = {arm: bounds.get(arm[0]) for arm in args.arms}
    results: dict = {arm: [] for arm in args.arms}
    share = step_time.FIXED_SHARE
    try:
        llm.generate([[1000 + i for i in range(64)]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for model in bounds.values():
            sched.step_time = sched.step_clock = model
            warm = [replace(w, max_tokens=8) for w in work[:4]]
            run_burst(eng, warm, params, f"warm{model.max_step_time}", None)
        if clock is not None:
            clock.take()
        for r in range(args.rounds):
            for arm in args.arms if r % 2 == 0 else args.arms[::-1]:
                sched.step_time = sched.step_clock = models[arm]
                sched.max_num_batched_tokens, step_time.FIXED_SHARE = arm[1], arm[2]
                got = run_burst(eng, work, params, f"r{r}-{arm}", clock)
                results[arm].append(got)
                print(f"round {r} arm {fmt(arm)}: {line(got)}", flush=True)
    finally:
        step_time.FIXED_SHARE = share
        if clock is not None:
            clock.close()
        llm.shutdown()
    for arm, got in results.items():
        best = min(got, key=lambda g: g["seconds"])
        print(f"arm {fmt(arm)} best of {len(got)}: {line(best)}")
        for kind in ("prefill", "decode"):
            split = best[f"{kind}_steps_split_s"]
            whole = sum(split.values()) or 1.0
            print(f"  {kind} steps {whole:.2f} s: " + ", ".join(
                f"{k} {v:.2f} s ({v / whole:.0%})" for k, v in sorted(split.items(), key=lambda kv: -kv[1])))
    write_json(args.json, {"model": args.model,
                           "arms": [{"arm": fmt(a), "rounds": g} for a, g in results.items()]})
    return results


def fmt(arm) -> str:
    return f"{arm[0]:g}ms/{arm[1]}/share {arm[2]:g}"


def line(g: dict) -> str:
    return (f"{g['seconds']:.1f} s, {g['tok_s']:.1f} tok/s, {g['steps']} steps ({g['prefill_steps']} with "
            f"prefill), chunks {g['chunks']} (p50 {g['chunk_p50']:.0f}, {g['chunk_min']}-{g['chunk_max']}), "
            f"prefill step p50 {g['prefill_step_p50_s'] * 1e3:.0f} ms, TTFT p50 {g['ttft_p50_s']:.1f} s, "
            f"ITL p50 {g['itl_p50_s'] * 1e3:.0f} ms p99 {g['itl_p99_s'] * 1e3:.0f} ms"
            + (" fit p50 c0 {:.3f} s, a {:.2f} ms/token, b {:.2e} s/pair".format(
                g["fit_p50"][0], g["fit_p50"][1] * 1e3, g["fit_p50"][2]) if g["fit_p50"] else ""))


if __name__ == "__main__":
    main()
