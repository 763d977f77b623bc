"""One stream's decode step of a linear-attention hybrid in process (``python -m
kvserve.benchmarks.scale.hybrid.decode --model DIR``; a Qwen3.5 checkpoint, e.g. the scale harness's
qwen3.5-2b): one sequence at ``--context`` tokens, then decode steps (temperature 0.6, as the served
comparison samples).

- ``--breakdown``: where a step's time goes on the per-op path, by part (forward hooks on the
  modules, the sampler wrapped), each projection's weight bytes over its time (GB/s) next to the
  machine's read bandwidth measured in the same run (``ceiling.memory_bandwidth``), and the same
  projections run back to back on their own (no Python or small ops between them): what is the
  weights' read, what is overhead.
- ``--ab``: the decode step through the hybrid's fused C step (engine/models/decode_row_hybrid.py)
  against the per-op path, in alternating rounds (every arm sees the same load); ms per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.ceiling import memory_bandwidth
from kvserve.benchmarks.instruments.engine_steps import Timed, abort_all, alternate, patched, prefill_batch
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.qwen3_5 import LINEAR, GatedDeltaNet

GB = 1e9


class Clock:
    """Wall seconds per part, added up by forward pre-/post-hooks (nested parts time alike)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._started: dict[int, float] = {}
        self._handles = []

    def watch(self, module, name: str) -> None:
        def pre(mod, _args):
            self._started[id(mod)] = time.perf_counter()

        def post(mod, _args, _out):
            spent = time.perf_counter() - self._started.pop(id(mod))
            self.seconds[name] = self.seconds.get(name, 0.0) + spent
        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def weight_bytes(module) -> int:
    return sum(p.nbytes for p in module.parameters(recurse=True))


def parts(model) -> list[tuple[str, object]]:
    """(part name, module) of every layer: the linear layers' projections and the whole mixer, the
    full-attention layers' projections, attention and whole mixer, the MLPs by layer kind."""
    out = []
    for layer in model.model.layers:
        kind = "gdn" if layer.layer_type == LINEAR else "full"
        if kind == "gdn":
            mixer = layer.linear_attn
            out += [("gdn in_proj", mixer.in_proj), ("gdn out_proj", mixer.out_proj), ("gdn mixer", mixer)]
        else:
            mixer = layer.self_attn
            out += [("full qkv_proj", mixer.qkv_proj), ("full o_proj", mixer.o_proj),
                    ("full attention", mixer.attn), ("full mixer", mixer)]
        out += [(f"{kind} mlp", layer.mlp), ("norms", layer.input_layernorm),
                ("norms", layer.post_attention_layernorm), (f"{kind} layer", layer)]
    return out + [("lm_head", model.lm_head), ("final norm", model.model.norm), ("layers+embed", model.model)]


def engine_args(args, tag_seed: int) -> SimpleNamespace:
    return SimpleNamespace(batch=1, context=args.context, seed=tag_seed, context_spread=0, steps=args.steps,
                           rounds=args.rounds, temperature=0.6)


def breakdown(llm: LLM, args) -> dict:
    eng = llm.engine
    model = eng.executor.model
    params = SamplingParams(temperature=0.6, max_tokens=args.steps * (args.rounds + 1) + 8, ignore_eos=True)
    prefill_batch(eng, engine_args(args, 1), params, "breakdown")
    clock = Clock()
    bytes_of: dict[str, int] = {}
    for name, module in parts(model):
        clock.watch(module, name)
        if name.endswith(("proj", "mlp")) or name == "lm_head":
            bytes_of[name] = bytes_of.get(name, 0) + (
                module.weight.nbytes if name == "lm_head" else weight_bytes(module))
    decode = Timed(GatedDeltaNet._decode)
    normed = Timed(GatedDeltaNet._normed)
    steps: list[float] = []
    fused, model.model._decode_row = model.model.decode_row(), None  # the per-op path, module by module
    try:
        with patched(GatedDeltaNet, "_decode", lambda self, *a: decode(self, *a)), \
                patched(GatedDeltaNet, "_normed", lambda self, *a: normed(self, *a)), \
                patched(eng, "sampler", Timed(eng.sampler)) as sampler:
            eng.step()  # warm-up
            clock.seconds.clear()
            decode.seconds = normed.seconds = sampler.seconds = 0.0
            for _ in range(args.steps * args.rounds):
                t0 = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t0)
    finally:
        clock.remove()
        abort_all(eng)
        model.model._decode_row = fused
    n = len(steps)
    ms = {name: s / n * 1e3 for name, s in clock.seconds.items()}
    ms["gdn conv+rule (C)"] = decode.seconds / n * 1e3
    ms["gdn gated norm (C)"] = normed.seconds / n * 1e3
    ms["sampler"] = sampler.seconds / n * 1e3
    ms["step (mean)"] = sum(steps) / n * 1e3
    ms["step (median)"] = statistics.median(steps) * 1e3
    alone = projections_alone(model, args)
    bandwidth = memory_bandwidth()
    return {"ms": ms, "bytes": bytes_of, "alone_ms": alone, "bandwidth_gb_s": bandwidth / GB,
            "step_bytes": sum(bytes_of.values())}


def projections_alone(model, args) -> dict[str, float]:
    """Each kind of projection over all of its layers, back to back, one row (best of 3), ms."""
    dtype = model.lm_head.weight.dtype
    x = torch.randn(1, model.config.hidden_size, dtype=dtype)
    groups: dict[str, list] = {}
    for name, module in parts(model):
        if name.endswith("proj") or name == "lm_head":
            groups.setdefault(name, []).append(module)
    out = {}
    with torch.inference_mode():
        for name, modules in groups.items():
            inputs = [torch.randn(1, m.input_size if hasattr(m, "input_size") else x.shape[1], dtype=dtype)
                      for m in modules]
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for m, row in zip(modules, inputs, strict=True):
                    m(row)
                best = min(best, time.perf_counter() - t0)
            out[name] = best * 1e3
    return out


def print_breakdown(r: dict) -> None:
    ms, step = r["ms"], r["ms"]["step (mean)"]
    print(f"decode step, one stream: mean {step:.1f} ms, median {r['ms']['step (median)']:.1f} ms; "
          f"weights read per step {r['step_bytes'] / GB:.2f} GB; "
          f"read bandwidth {r['bandwidth_gb_s']:.1f} GB/s "
          f"(bound {r['step_bytes'] / GB / r['bandwidth_gb_s'] * 1e3:.1f} ms)")
    for name, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        if name.startswith("step"):
            continue
        extra = ""
        if name in r["bytes"]:
            extra = f"  {r['bytes'][name] / GB / (v / 1e3):6.1f} GB/s in the step"
            if name in r["alone_ms"]:
                extra += f", {r['bytes'][name] / GB / (r['alone_ms'][name] / 1e3):6.1f} GB/s alone"
        print(f"  {name:<22} {v:8.2f} ms {100 * v / step:5.1f}%{extra}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.hybrid.decode",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Qwen3.5 checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true", help="time the step by part")
    ap.add_argument("--ab", action="store_true", help="the fused hybrid step against the per-op path")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if not (args.breakdown or args.ab):
        ap.error("say --breakdown, --ab or both")
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, max_model_len=args.context + 4 * args.steps
              * (args.rounds + 2) + 64, max_num_batched_tokens=512, max_step_time_ms=0,
              enable_prefix_caching=False)
    result: dict = {"model": args.model, "context": args.context, "threads": torch.get_num_threads()}
    try:
        if not any(isinstance(m, GatedDeltaNet) for m in llm.engine.executor.model.modules()):
            raise SystemExit(f"{args.model} has no Gated DeltaNet layers")
        if args.breakdown:
            result["breakdown"] = breakdown(llm, args)
            print_breakdown(result["breakdown"])
        if args.ab:
            result["ab"] = fused_ab(llm, args)
    finally:
        llm.shutdown()
    write_json(args.json, result)
    return result


def fused_ab(llm: LLM, args) -> dict:
    model = llm.engine.executor.model.model
    fused = model.decode_row()
    if fused is None:
        raise SystemExit("--ab: the fused hybrid decode step does not apply here")
    arms = {"fused": lambda: setattr(model, "_decode_row", fused),
            "per_op": lambda: setattr(model, "_decode_row", None)}
    r = alternate(llm.engine, engine_args(args, 2), arms, "ab")
    model._decode_row = fused
    print(f"decode step, one stream at {args.context} tokens (median of alternating rounds): fused "
          f"{r['fused']:.1f} ms, per-op {r['per_op']:.1f} ms: {r['per_op'] / r['fused']:.2f}x; rounds "
          f"{r['rounds_ms']}")
    return r


if __name__ == "__main__":
    main()
