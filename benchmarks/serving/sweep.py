"""A serving sweep: the same workload over gRPC at each concurrency level, against one server
(benchmarks/serving/bench.py with ``--concurrency 1,8,32,128``); its results as JSON and, with
``--plot``, a figure of throughput and TTFT / ITL percentiles against concurrency
(benchmarks/plots.py). Only the service runs: each level is one closed loop of that many clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from kvserve.benchmarks import write_json
from kvserve.benchmarks.serving.load import Request, run_grpc, server_flags
from kvserve.benchmarks.serving.report import print_report, summarize


def run_sweep(args: argparse.Namespace, work: list[Request], levels: list[int]) -> int:
    workload = (f"{len(work)} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
                f"output {args.output_len[0]}-{args.output_len[1]} tokens")
    print(f"sweep: concurrency {levels}; {workload}")
    runs = []
    with server_target(args, len(work)) as target:
        for level in levels:
            runs.append(summarize(*asyncio.run(run_grpc(target, work, level))))
            print_report(f"service (gRPC), concurrency {level}", runs[-1])
    result = {"levels": levels, "service": runs, "workload": workload,
              "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    write_json(args.json, result)
    if args.plot:
        from kvserve.benchmarks.plots import plot_serving_sweep

        plot_serving_sweep(result, args.plot)
        print(f"figure: {args.plot}")
    return 0


@contextlib.contextmanager
def server_target(args: argparse.Namespace, num_requests: int):
    """``--target``, or one server started for the whole sweep."""
    if args.target:
        yield args.target
        return
    from kvserve.testing.process import ServerProcess

    with ServerProcess(*server_flags(args, num_requests)) as server:
        yield server.target
