"""Driving an ``LLMEngine``'s steps for the step benchmarks, and the two measurements of
``profile_step`` that need no matmul ceiling: the host work of a decode step (``--host-profile``)
and the same decode steps under two arms in alternating rounds: the fused decode step against the
per-op path (``--fused-ab``), csrc/gemm.c's packed weights against oneDNN's (``--gemm-ab``). The
flags and their documentation are ``profile_step``'s; it calls ``host_main`` and ``ab_main``.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch

from kvserve.benchmarks import write_json
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.cpu_matmul import onednn_bf16
from kvserve.engine.models.decode_row import projections as _projections
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS, PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels


class Timed:
    """Wraps a callable and adds up the seconds spent in it, by ``clock`` (wall time by default)."""

    def __init__(self, fn, clock=time.perf_counter):
        self.fn, self.seconds, self.clock = fn, 0.0, clock

    def __call__(self, *args, **kwargs):
        t0 = self.clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += self.clock() - t0

    def __getattr__(self, name):
        return getattr(self.fn, name)


def random_prompts(n: int, length: int, vocab: int, seed: int, spread: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``length`` tokens, or of ``length ± spread`` uniformly."""
    rng = random.Random(seed)
    lengths = [rng.randint(max(1, length - spread), length + spread) for _ in range(n)]
    return [[rng.randrange(vocab) for _ in range(k)] for k in lengths]


def prefill_batch(eng, args, params: SamplingParams, tag: str) -> None:
    """Add ``args.batch`` requests and step until every one has its first token."""
    vocab = min(10000, eng.vocab_size)
    for i, p in enumerate(random_prompts(args.batch, args.context, vocab, args.seed, args.context_spread)):
        eng.add_request(f"{tag}-{i}", p, params)
    while any(r.seq.num_completion_tokens == 0 for r in eng.requests.values()):
        eng.step()


def abort_all(eng) -> None:
    for rid in list(eng.requests):
        eng.abort(rid)
    eng.step()


@contextlib.contextmanager
def patched(obj, attr: str, value):
    """``obj.attr = value`` inside the block; the attribute as it was afterwards."""
    own = attr in vars(obj)
    before = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield value
    finally:
        if own:
            setattr(obj, attr, before)
        else:
            delattr(obj, attr)  # the class's method again


def profile_host(llm: LLM, args) -> dict:
    """CPU milliseconds of the stepping thread per decode step besides the forward pass (see the
    module docstring), by stage; ``execute_model`` is the runner's share without the forward."""
    import cProfile
    import pstats

    from kvserve.engine.core import llm_engine
    from kvserve.engine.core.ipc import Codec, StepDone

    eng, clock = llm.engine, time.thread_time
    eng.detokenize = not args.core  # the engine-core process leaves the text to the front-end
    if args.core:
        from kvserve.engine.process.gc_tuning import tune_gc

        tune_gc()  # and tunes its collector once loaded
    prefill_steps = -(-args.batch * (args.context + args.context_spread) // eng.config.max_num_batched_tokens)
    # no request may finish during the timed steps: they run at batch ``args.batch``
    params = SamplingParams(temperature=args.temperature, max_tokens=prefill_steps + args.steps + 8,
                            ignore_eos=True)
    prefill_batch(eng, args, params, "host")
    model = eng.executor.model
    targets = {"forward": (model, "forward"), "compute_logits": (model, "compute_logits"),
               "schedule": (eng.scheduler, "schedule"),
               "build_model_input": (llm_engine, "build_model_input"),
               "execute_model": (eng.executor, "execute_model"), "sampler": (eng, "sampler"),
               "postprocess": (eng.scheduler, "postprocess")}
    codec, encode_s, step_s = Codec(), 0.0, 0.0
    profiler = cProfile.Profile() if args.cprofile else contextlib.nullcontext()
    with contextlib.ExitStack() as patches:
        timed = {name: patches.enter_context(patched(obj, attr, Timed(getattr(obj, attr), clock)))
                 for name, (obj, attr) in targets.items()}
        eng.step()  # warm-up at this shape
        for t in timed.values():
            t.seconds = 0.0
        with profiler:
            for _ in range(args.steps):
                t0 = clock()
                outputs = eng.step()
                t1 = clock()
                codec.encode(StepDone(0, 0, outputs))  # what the engine-core process sends per step
                t2 = clock()
                step_s, encode_s = step_s + t1 - t0, encode_s + t2 - t1
    abort_all(eng)
    eng.detokenize = True
    if args.cprofile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    ms = 1e3 / args.steps
    split = {name: t.seconds * ms for name, t in timed.items()}
    forward_ms = split.pop("forward") + split.pop("compute_logits")
    split["execute_model"] -= forward_ms
    split["encode_step_done"] = encode_s * ms
    host_ms = (step_s + encode_s) * ms - forward_ms
    split["other"] = host_ms - sum(split.values())  # output handling, detokenization, the rest
    return {"batch": args.batch, "context": args.context, "context_spread": args.context_spread,
            "steps": args.steps, "detokenize": not args.core, "host_ms": host_ms,
            "forward_cpu_ms": forward_ms, "stages_ms": split}


def alternate(eng, args, arms: dict, tag: str) -> dict:
    """Decode steps at ``args.batch`` under each of ``arms`` (name -> a function that switches the
    model to it), in ``args.rounds * 2`` alternating rounds of ``args.steps`` steps (every arm sees
    the same load); the median round of each, ms per step."""
    params = SamplingParams(temperature=args.temperature, max_tokens=args.rounds * 4 * (args.steps + 1) + 8,
                            ignore_eos=True)
    prefill_batch(eng, args, params, tag)
    rounds: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for _ in range(args.rounds * 2):
            for name, switch in arms.items():
                switch()
                eng.step()  # warm-up on this arm
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                rounds[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    finally:
        abort_all(eng)
    return {name: statistics.median(v) for name, v in rounds.items()} | {"rounds_ms": rounds}


def profile_fused(llm: LLM, args) -> dict:
    """The fused decode step against the per-op path (``alternate``)."""
    model = llm.engine.executor.model.model
    fused = model.decode_row()
    if fused is None:
        raise SystemExit("the fused decode step does not apply to this model (engine/models/decode_row.py)")
    packed = all(isinstance(m.packed, PackedWeight) for m in _projections(model))
    if not packed and not load_kernels().fused_row_kernel:
        raise SystemExit("--fused-ab: without AVX-512 the fused step takes only bfloat16 projections "
                         "packed for csrc/gemm.c")
    if args.batch > MAX_FUSED_ROWS and not packed:
        raise SystemExit(f"--fused-ab: above {MAX_FUSED_ROWS} sequences the fused step needs every "
                         "projection packed for csrc/gemm.c (bfloat16, an AVX-512 or AVX2 build, no AMX)")
    try:
        return alternate(llm.engine, args, {"fused": lambda: setattr(model, "_decode_row", fused),
                                            "per_op": lambda: setattr(model, "_decode_row", None)}, "fused")
    finally:
        model._decode_row = fused


def profile_gemm(llm: LLM, args) -> dict:
    """The projections through csrc/gemm.c's packed copies (as loaded) against oneDNN's packed
    copies of the same weights (torch's plain bfloat16 matmul where oneDNN has no bfloat16 path:
    CPUs without AVX-512), swapped between rounds (``alternate``), both on the per-op path (the
    fused decode step, which takes such batches too, holds gemm.c's copies)."""
    layers = [m for m in llm.engine.executor.model.modules()
              if isinstance(getattr(m, "packed", None), PackedWeight)]
    if not layers:
        raise SystemExit("--gemm-ab: no projection multiplies through csrc/gemm.c here (it needs bfloat16 "
                         "and AVX-512 or AVX2; CPUs with AMX keep oneDNN)")
    ours = [m.packed for m in layers]
    if onednn_bf16():
        other, copies = "onednn", [torch.ops.mkldnn._reorder_linear_weight(m.weight.data.contiguous(), None)
                                   for m in layers]
    else:  # linear() multiplies an unpacked weight with F.linear
        other, copies = "torch", [None] * len(layers)

    model = llm.engine.executor.model.model
    fused, model._decode_row = model.decode_row(), None

    def use(copies):
        return lambda: [setattr(m, "packed", c) for m, c in zip(layers, copies, strict=True)]
    try:
        return alternate(llm.engine, args, {"gemm": use(ours), other: use(copies)}, "gemm")
    finally:
        use(ours)()
        model._decode_row = fused


def ab_main(llm: LLM, args) -> dict:
    """``--fused-ab`` or ``--gemm-ab``: one line, the median step of each arm and their ratio."""
    fused = args.fused_ab
    try:
        result = {"batch": args.batch, "threads": torch.get_num_threads(),
                  **(profile_fused if fused else profile_gemm)(llm, args)}
    finally:
        llm.shutdown()
    new, old = ("fused", "per_op") if fused else ("gemm", "onednn" if "onednn" in result else "torch")
    label = {"fused": "fused", "per_op": "per-op", "gemm": "gemm.c", "onednn": "oneDNN", "torch": "torch"}
    print(f"decode step, batch {args.batch}, {args.context}-token contexts (median of alternating rounds): "
          f"{label[new]} {result[new]:.1f} ms, {label[old]} {result[old]:.1f} ms: "
          f"{result[old] / result[new]:.2f}x")
    write_json(args.json, result)
    return result


def host_main(llm: LLM, args) -> dict:
    try:
        result = {"threads": torch.get_num_threads(), "host": profile_host(llm, args)}
    finally:
        llm.shutdown()
    h = result["host"]
    stages = ", ".join(f"{name} {v:.2f}" for name, v in h["stages_ms"].items())
    where = "in process (detokenizing)" if h["detokenize"] else "as the engine core (no detokenizing)"
    print(f"host CPU per decode step {where}, batch {h['batch']}, contexts "
          f"{h['context']}±{h['context_spread']}, {h['steps']} steps: {h['host_ms']:.2f} ms besides "
          f"the forward ({h['forward_cpu_ms']:.2f} ms); by stage (ms): {stages}")
    write_json(args.json, result)
    return result
