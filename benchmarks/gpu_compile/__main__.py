"""python -m kvserve.benchmarks.gpu_compile [--table quick|full] [--targets sm_80,sm_89,sm_90] [--jobs N]

Compiles the table's kernels for each target (the full table: fla-core's gated delta rule kernels
too, as its host code launches them: fla_kernels.py), prints one row per (kernel, shape, target) and
exits 1 on a compile error, a spill, or shared memory over the target's limit (for fla-core's
autotuned kernels: where no configuration of a kernel is clean; 2 when this triton cannot compile
for CUDA at all). No GPU is needed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from kvserve.benchmarks.gpu_compile.compile import Result, compile_case, nvidia_bin
from kvserve.benchmarks.gpu_compile.fla_kernels import fla_cases, fla_installed
from kvserve.benchmarks.gpu_compile.shapes import full_table, quick_table
from kvserve.benchmarks.gpu_compile.targets import TARGETS

HEADER = ("kernel", "shape", "dtype", "target", "warps", "stages", "regs", "spill B", "smem B",
          "warps/SM", "H200 roofline us", "status")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.benchmarks.gpu_compile", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--table",
        choices=("quick", "full"),
        default="full",
        help="quick: the representative subset `make test` compiles; full: every shape",
    )
    parser.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}"
    )
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    return parser.parse_args(argv)


def row(r: Result) -> tuple[str, ...]:
    c = r.case
    status = "; ".join(r.problems()) or "ok"
    roofline = "-" if c.recorded >= 0 else f"{r.roofline_us:.1f}"  # none for fla-core's kernels
    if r.error:
        return (c.kernel, c.shape, c.dtype, r.target.name, str(c.launch.num_warps), str(c.launch.num_stages),
                "-", "-", "-", "-", roofline, status)  # fmt: skip
    return (c.kernel, c.shape, c.dtype, r.target.name, str(c.launch.num_warps), str(c.launch.num_stages),
            str(r.regs), str(r.spills), str(r.smem), str(r.warps_per_sm), roofline, status)  # fmt: skip


def markdown(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _compile(job):
    return compile_case(*job)


def run(table: str, targets: list[str], kernel: str = "", jobs: int = 1) -> list[Result]:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    cases = quick_table() if table == "quick" else full_table()
    if table == "full":  # fla-core's gated delta rule kernels (the hybrids' GPU path)
        cases += fla_cases()
    cases = [c for c in cases if kernel in c.kernel]
    work = [(case, TARGETS[t]) for case in cases for t in targets]
    if jobs <= 1:
        return [_compile(w) for w in work]
    # spawned, not forked: a fork of this process after fla-core's host code ran (torch's threads)
    # hung in its workers
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        # (compile_case itself: a spawned worker finds no __main__._compile)
        return list(pool.map(compile_case, [case for case, _ in work], [target for _, target in work]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault(
        "TRITON_DEFAULT_FP_FUSION", "1"
    )  # Triton 3.9's default, stated to silence its warning
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it", file=sys.stderr)
        return 2
    try:
        nvidia_bin()
    except (ImportError, RuntimeError) as e:
        print(f"cannot compile for CUDA: {e}", file=sys.stderr)
        return 2
    if args.table == "full" and not fla_installed():
        print("the full table compiles fla-core's kernels and needs fla-core: pip install .[gpu] "
              "(`make gpu-compile` makes a venv with it: .venv-gpu-compile)", file=sys.stderr)
        return 2
    results = run(args.table, [t for t in args.targets.split(",") if t], args.kernel, args.jobs)
    print(markdown([row(r) for r in results]))
    bad = [r for r in results if r.problems()]
    failed = failures(results)
    print(f"\n{len(results)} compiles, {len(bad)} with problems, {len(bad) - len(failed)} of them autotune "
          f"configurations of fla-core's beside a clean one", file=sys.stderr)
    return 1 if failed else 0


def failures(results: list[Result]) -> list[Result]:
    """The results that fail the table: every problem of the engine's own kernels (each launches one
    configuration), and of fla-core's autotuned kernels (``recorded``) only those of a kernel, shape
    and target without a single clean configuration. An autotuner skips a configuration that does
    not fit (shared memory) and times the rest: a spilling one costs speed, not results, and the
    GPU check's timings show which it picked (docs/performance/gpu_compile.md)."""
    clean = {(r.case.kernel, r.case.shape, r.target.name) for r in results
             if r.case.recorded >= 0 and not r.problems()}
    return [r for r in results if r.problems()
            and not (r.case.recorded >= 0 and (r.case.kernel, r.case.shape, r.target.name) in clean)]


if __name__ == "__main__":
    sys.exit(main())
