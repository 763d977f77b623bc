"""A speculative verification through one Gated DeltaNet layer on the CPU, the two ways of leaving
each sequence's state at its accepted position, in one run
(``python -m kvserve.benchmarks.scale.hybrid.verify``; docs/design/hybrid-state-cache.md):

- recompute (what kvserve does, ``GatedDeltaNet._decode_rows`` then ``roll_back``): keep the
  state from before the step (one copy), step the k + 1 rows in place; when only j + 1 rows are
  kept, put the copy back and step those rows again;
- per position (vLLM's way on GPUs, as the alternative): step the k + 1 rows in place and copy the
  state after each row aside (k + 1 copies, into rows allocated once), then copy the kept one back
  into the slot.

Both use the layer's decode step (the C kernel on the CPU), on ``--batch`` sequences of a state
cache of ``--slots`` rows, k drafts each, for every k of ``--drafts`` and j accepted of none, half
and all. They alternate, ``--repeats`` times each; each figure is the fastest of its repeats, in
ms per verification step, beside their ratio and whether both left the same states.
"""

from __future__ import annotations

import argparse
import functools

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.ceiling import best_time
from kvserve.benchmarks.scale.hybrid.gated_delta import CPU, inputs, make_layer
from kvserve.engine.models.qwen3_5 import GatedDeltaNet


def recompute(layer: GatedDeltaNet, rows, slots: list[int], kept: int) -> None:
    layer._decode_rows(*rows, [s for s in slots for _ in range(len(rows[0]) // len(slots))])
    if kept < len(rows[0]) // len(slots):
        layer.roll_back([[s, kept] for s in slots])


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per-position rows, made once per shape


def per_position(layer: GatedDeltaNet, rows, slots: list[int], kept: int) -> None:
    mixed, g, beta = rows
    per = len(mixed) // len(slots)
    index = torch.tensor(slots)
    key = (per, len(slots), layer.conv_states.shape, layer.recurrent_states.shape)
    if key not in _SCRATCH:  # (kept rows beside the slots, as a cache would hold them: not timed)
        _SCRATCH[key] = (layer.conv_states.new_zeros(per, len(slots), *layer.conv_states.shape[1:]),
                         layer.recurrent_states.new_zeros(per, len(slots), *layer.recurrent_states.shape[1:]))
    conv, recurrent = _SCRATCH[key]
    for j in range(per):
        wave = torch.arange(len(slots)) * per + j
        layer._decode(mixed[wave], g[wave], beta[wave], slots)
        conv[j] = layer.conv_states[index]
        recurrent[j] = layer.recurrent_states[index]
    layer.conv_states[index] = conv[kept - 1]
    layer.recurrent_states[index] = recurrent[kept - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.hybrid.verify",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-2b", choices=("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-tiny"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences verifying")
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8], help="k: drafts per sequence")
    ap.add_argument("--slots", type=int, default=16, help="rows of the state cache")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch's (and the kernels') threads (default: torch's)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if max(args.batch) > args.slots:
        raise SystemExit(f"--slots ({args.slots}) must hold the largest --batch ({max(args.batch)})")
    layer = make_layer(args.shape, dtype, args.slots)
    kernels = layer._kernels(torch.empty(1, layer.conv_size, dtype=dtype))
    print(f"{args.shape} linear layer, {args.dtype}, {torch.get_num_threads()} threads, decode step: "
          f"{'C, ' + str(kernels.vector_bits or 'portable') + '-bit vectors' if kernels else 'torch'}")
    start = layer.conv_states.clone(), layer.recurrent_states.clone()
    figures: list[dict] = []
    with torch.no_grad():
        for batch in args.batch:
            slots = list(range(args.slots - 1, -1, -max(1, args.slots // batch)))[:batch]
            for k in args.drafts:
                rows = inputs(layer, batch * (k + 1), dtype, batch * 100 + k)
                for accepted in sorted({0, k // 2, k}):
                    ways = {"recompute": recompute, "per_position": per_position}
                    states, best = {}, dict.fromkeys(ways, float("inf"))
                    for name, way in ways.items():  # the states each leaves, from the same start
                        layer.conv_states.copy_(start[0])
                        layer.recurrent_states.copy_(start[1])
                        way(layer, rows, slots, accepted + 1)
                        states[name] = layer.conv_states.clone(), layer.recurrent_states.clone()
                    same = all(torch.equal(a, b) for a, b in zip(*states.values(), strict=True))
                    for i in range(args.repeats):
                        for name in (ways if i % 2 == 0 else reversed(ways)):
                            run = functools.partial(ways[name], layer, rows, slots, accepted + 1)
                            best[name] = min(best[name], best_time(run, CPU, 1))
                    r, p = best["recompute"], best["per_position"]
                    figures.append({"batch": batch, "drafts": k, "accepted": accepted,
                                    "recompute_ms": r * 1e3, "per_position_ms": p * 1e3, "same_states": same})
                    print(f"batch {batch:>3} k {k:>2} accepted {accepted:>2}: recompute {r * 1e3:8.3f} ms  "
                          f"per position {p * 1e3:8.3f} ms  per position / recompute {p / r:5.2f}x  "
                          f"(same states: {same})", flush=True)
    write_json(args.json, {"shape": args.shape, "dtype": args.dtype, "verify": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
