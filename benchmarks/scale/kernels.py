"""The GGUF kernels alone at a 1.7B model's projection shapes, against the bfloat16 product of the
same weights dequantized, in one run (``python -m kvserve.benchmarks.scale.kernels``): per format
(Q4_K, Q6_K, Q8_0) and row count, milliseconds per product (activation quantization included),
weight bytes per second and the ratio to ``cpu_matmul.linear`` on the dequantized bfloat16 weight
(csrc/gemm.c's packed copy where it is built). From ``GEMM_FROM_ROWS`` rows it also times the
paths of ``GGUFWeight.linear``: the int8 GEMM (csrc/kquant_gemm.c), the dots and bfloat16 panels
dequantized 256 rows at a time into the float GEMM, interleaved round by round (``--rounds``; the
best round of each), with the GEMM's int8 GOP/s against a tight vpdpbusd loop's in the same run
and its parts (activation quantization, the panels' unpacking); for Q4_K on AVX512-VNNI also the
repacked weight the loader keeps (``REPACKED``: the same tiles, no unpacking). ``--clock thread
--threads 1`` times one thread's CPU time instead of the wall clock (the peak too), so that other processes'
share of a loaded machine drops out; ``--against SO`` adds another build's GEMM (e.g. main's shared
object from kernels/cpu/build.py's cache) to the same interleaved rounds, and its repacked product
beside this build's. Random valid blocks; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvserve.kernels.cpu.kquant import BLOCK_TYPES, REPACKED, kquant_kernels

NAMES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "Q4_0": 2}
SCALE_AT = {12: (0, 2), 13: (0, 2), 14: (208,), 8: (0,), 2: (0,)}  # each format's float16 scales in its block


def random_weight(ggml_type: int, n_out: int, k: int, seed: int = 0) -> torch.Tensor:
    values, size = BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_out * k // values, size), dtype=np.uint8)
    for at in SCALE_AT[ggml_type]:
        halves = (rng.standard_normal(len(blocks)) * 1e-3).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n_out, -1))


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def best_of_interleaved(fns: dict, rounds: int, clock=time.perf_counter) -> dict:
    """Each function's best time over ``rounds`` rounds, the functions taking turns every round (so
    that the load of a shared machine falls on all of them alike); ``clock``: the wall clock, or
    ``time.thread_time`` (one thread's CPU time: other processes' share of the cores drops out)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def prefill_paths(kernels, name: str, ggml_type: int, n_out: int, k: int, rows: int, rounds: int,
                  peak: float = 0.0, clock=time.perf_counter, against=None) -> str:
    """One line: a product of ``rows`` rows by the int8 GEMM, by the few-row dots and by
    dequantized bfloat16 panels (what ``GGUFWeight.linear`` chooses between), milliseconds, best
    of interleaved rounds; the GEMM's int8 rate against ``peak`` (GOP/s of all threads: 2 per
    multiply-add), and its parts: the activations' quantization, the panels' unpacking; with
    ``against`` (another build's kernels) that build's GEMM, unpacking and repacked product in the
    same rounds."""
    from kvserve.engine.layers.cpu_matmul import linear
    from kvserve.engine.layers.gguf_linear import PANEL_FROM_ROWS, PANEL_ROWS, GGUFTensor, gemm_from_rows

    weight = random_weight(ggml_type, n_out, k)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = torch.empty(rows, n_out, dtype=torch.bfloat16)

    def panels():
        for first in range(0, n_out, PANEL_ROWS):
            panel = GGUFTensor(weight[first : first + PANEL_ROWS], ggml_type, (n_out, k))
            dense = panel.dequantize(torch.bfloat16)
            out[:, first : first + panel.data.shape[0]] = linear(x, dense, few_rows=8)

    fns = {"panels": panels, "dots": lambda: kernels.matmul(weight, ggml_type, k, kernels.quantize(x), out)}
    if kernels.gemm_takes(ggml_type, preferred=False):
        act = kernels.quantize(x)
        fns["gemm"] = lambda: kernels.gemm(weight, ggml_type, k, kernels.quantize(x), out)
        # its parts: the activations' quantization, and the panels' unpacking (a 1-row product)
        fns["quantize"] = lambda: kernels.quantize(x)
        fns["unpack"] = lambda: kernels.gemm(weight, ggml_type, k, act[:1], out[:1])
        packed = kernels.repack(weight, ggml_type, k)  # Q4_K's repacked panels (AVX512-VNNI)
        if packed is not None:
            fns["repacked"] = lambda: kernels.gemm(packed, REPACKED[ggml_type], k, kernels.quantize(x), out)
        if against is not None:
            fns["gemm_against"] = lambda: against.gemm(weight, ggml_type, k, against.quantize(x), out)
            fns["unpack_against"] = lambda: against.gemm(weight, ggml_type, k, act[:1], out[:1])
            theirs = against.repack(weight, ggml_type, k)
            if packed is not None and theirs is not None:
                fns["repacked_against"] = lambda: against.gemm(theirs, REPACKED[ggml_type], k,
                                                               against.quantize(x), out)
    best = best_of_interleaved(fns, rounds, clock)
    cells = ", ".join(f"{key} {t * 1e3:8.2f} ms" for key, t in best.items())
    ratio = ""
    if "gemm" in best:
        ops = 2 * rows * n_out * k / best["gemm"] / 1e9
        ratio = (f": gemm {best['panels'] / best['gemm']:.2f}x the panels, "
                 f"{best['dots'] / best['gemm']:.2f}x the dots, {ops:.0f} int8 GOP/s"
                 + (f" = {ops / peak:.0%} of the vpdpbusd peak" if peak else "")
                 + (f", {best['gemm_against'] / best['gemm']:.2f}x the other build's" if against else "")
                 + (f"; repacked {best['gemm'] / best['repacked']:.2f}x the gemm"
                    if "repacked" in best else "")
                 + (f", {best['repacked_against'] / best['repacked']:.2f}x the other build's repacked"
                    if "repacked_against" in best else ""))
    part = GGUFTensor(weight, ggml_type, (n_out, k))
    gemm = kernels.gemm_takes(ggml_type) and k % 256 == 0 and rows >= gemm_from_rows(kernels, part)
    dots = rows < PANEL_FROM_ROWS or kernels.dots_over_panels(ggml_type)
    chosen = "gemm" if gemm else "dots" if dots else "panels"
    return f"{name} prefill rows {rows:4d}: {cells}{ratio} (linear takes {chosen})"


def compare(kernels, name: str, ggml_type: int, n_out: int, k: int, rows: int, repeat: int) -> str:
    """One line: the GGUF product of ``rows`` rows against the bfloat16 one of the same weight."""
    from kvserve.engine.layers.cpu_matmul import linear, pack_weight

    weight = random_weight(ggml_type, n_out, k)
    dense = kernels.dequantize(weight, ggml_type, k, torch.bfloat16)
    packed = pack_weight(dense)
    x = torch.randn(rows, k).to(torch.bfloat16)
    out = torch.empty(rows, n_out, dtype=torch.bfloat16)
    ours = timed(lambda: kernels.matmul(weight, ggml_type, k, kernels.quantize(x), out), repeat)
    theirs = timed(lambda: linear(x, dense, packed=packed, few_rows=8), repeat)
    rate = weight.numel() / ours / 1e9
    repacked, line = kernels.repack(weight, ggml_type, k), ""
    if repacked is not None:  # Q4_K's repacked panels (AVX512-VNNI): what the loader keeps
        t = timed(lambda: kernels.matmul(repacked, REPACKED[ggml_type], k, kernels.quantize(x), out), repeat)
        line = f", repacked {t * 1e3:8.2f} ms ({ours / t:.2f}x the blocks)"
    return (f"{name} rows {rows:4d}: {ours * 1e3:8.2f} ms ({rate:5.1f} GB/s of blocks), "
            f"bf16 {theirs * 1e3:8.2f} ms: {theirs / ours:.2f}x{line}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.scale.kernels",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x2048", help="output rows x inputs (gate/up of a 1.7B model)")
    ap.add_argument("--rows", default="1,8,512", help="activation rows per product")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the prefill paths")
    ap.add_argument("--types", default=",".join(NAMES), help="formats, comma-separated")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="the prefill paths' clock: wall, or one thread's CPU time (needs --threads 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch has them)")
    ap.add_argument("--against", default=None,
                    help="another build's shared object (from kernels/cpu/build.py): its GEMM, same rounds")
    args = ap.parse_args(argv)
    n_out, k = (int(v) for v in args.shape.split("x"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        ap.error("--clock thread times one thread: give --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    kernels = kquant_kernels()
    against = None
    if args.against:
        from kvserve.kernels.cpu.bindings import CpuKernels
        from kvserve.kernels.cpu.kquant import KQuantKernels

        against = KQuantKernels(CpuKernels(Path(args.against))._lib)
    from kvserve.engine.layers.gguf_linear import GEMM_FROM_ROWS

    peak = 2 * kernels.vnni_peak(clock=clock) / 1e9  # this run's int8 peak: a tight vpdpbusd loop a thread
    print(f"{n_out} x {k}, {torch.get_num_threads()} threads, dots: {kernels.isa or 'portable'}"
          + (f", vpdpbusd peak this run {peak:.0f} GOP/s" if peak else ""))
    for name in args.types.split(","):
        ggml_type = NAMES[name]
        for rows in (int(r) for r in args.rows.split(",")):
            print(compare(kernels, name, ggml_type, n_out, k, rows, args.repeat), flush=True)
            if rows >= GEMM_FROM_ROWS:
                print(prefill_paths(kernels, name, ggml_type, n_out, k, rows, args.rounds, peak,
                                    clock, against), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
