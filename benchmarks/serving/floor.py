"""The floor under streaming one message per token through Python gRPC on this machine.

A bare grpc.aio server (its own process, as the service's front-end is) with the kvserve
service's ``Stream`` method and nothing behind it: a ticker plays the engine's steps, and at
each tick every open stream sends one ``StreamResponse`` of the shape the front-end sends per
token (request id, a few characters of text, one token id). No engine, no IPC, no detokenizer.
The client is ``benchmarks/serving/bench.py``'s load generator (the raw stub, reading each message and
noting its time). Printed: CPU seconds per message of the server and of the client, and, given
the in-process engine's figures for the same workload, the best service / in-process throughput
ratio that CPU leaves on ``--cores`` cores:

    wall_service >= (cpu_in_process + messages * (server_us + client_us)) / cores

(the engine core's own CPU taken as the in-process engine's, everything else free). The issue-9
workload (512 requests x 200 tokens at concurrency 256, the tiny model's ~13 ms steps):

    python -m kvserve.benchmarks.serving.floor --num-requests 512 --concurrency 256 --tokens 200 \\
        --step-ms 13 --in-process-cpu 9.4 --in-process-wall 6.3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import time

import grpc

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.procfs import process_tree_cpu_s
from kvserve.benchmarks.serving.load import Request, stream_one


# ---- the bare server (run as ``--serve``) ---------------------------------------------------
class _Ticker:
    """The engine's steps: every ``step_s`` each waiting stream is woken once."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self._waiters: list[asyncio.Future] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def next(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut


async def _serve(step_s: float) -> None:
    from kvserve.v1 import llm_pb2, llm_pb2_grpc

    ticker = _Ticker(step_s)
    counter = itertools.count()

    class Bare(llm_pb2_grpc.LLMServiceServicer):
        async def Stream(self, request, context):  # noqa: N802 (the proto's name)
            rid = f"req-{next(counter):028d}"
            n = request.sampling.max_tokens
            for i in range(n):
                await ticker.next()
                msg = llm_pb2.StreamResponse(request_id=rid, text=" tok", token_ids=[10 + i % 1000])
                if i == n - 1:
                    msg.finish_reason = llm_pb2.LENGTH
                    msg.usage.completion_tokens = n
                yield msg

    server = grpc.aio.server()
    llm_pb2_grpc.add_LLMServiceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tick = asyncio.create_task(ticker.run())
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    tick.cancel()
    await server.stop(grace=None)


# ---- the measurement ------------------------------------------------------------------------
async def _load(target: str, work: list[Request], concurrency: int) -> tuple[float, int]:
    from kvserve.v1 import llm_pb2_grpc

    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        await stream_one(stub, Request([1], 2, 0.0))  # warm-up

        async def one(req: Request):
            async with limit:
                return await stream_one(stub, req)

        start = time.perf_counter()
        traces = await asyncio.gather(*(one(r) for r in work))
        wall = time.perf_counter() - start
    errors = [t.error for t in traces if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, first: {errors[0]}")
    return wall, sum(len(t.token_times) for t in traces)


def measure(args: argparse.Namespace) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.benchmarks.serving.floor", "--serve",
                             "--step-ms", str(args.step_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the bare server did not start (it printed {line!r})")
        port = int(line)
        work = [Request([1], args.tokens, 0.0) for _ in range(args.num_requests)]
        server0, client0 = process_tree_cpu_s(proc.pid), time.process_time()
        wall, messages = asyncio.run(_load(f"127.0.0.1:{port}", work, args.concurrency))
        server_s = process_tree_cpu_s(proc.pid) - server0
        client_s = time.process_time() - client0
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    return {"messages": messages, "wall_s": wall, "server_cpu_s": server_s, "client_cpu_s": client_s,
            "server_us_per_message": server_s / messages * 1e6,
            "client_us_per_message": client_s / messages * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200, help="messages per stream")
    ap.add_argument("--step-ms", type=float, default=13.0, help="the engine step the ticker plays")
    ap.add_argument("--in-process-cpu", type=float,
                    help="the in-process engine's CPU seconds for the workload (serving.py prints them)")
    ap.add_argument("--in-process-wall", type=float, help="... and its wall seconds")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.step_ms / 1e3))
        return 0
    r = measure(args)
    print(f"{r['messages']:,} messages over {args.concurrency} streams in {r['wall_s']:.1f} s: "
          f"server {r['server_cpu_s']:.2f} CPU-s ({r['server_us_per_message']:.1f} us a message), "
          f"client {r['client_cpu_s']:.2f} CPU-s ({r['client_us_per_message']:.1f} us a message)")
    if args.in_process_cpu is not None and args.in_process_wall is not None:
        floor_wall = (args.in_process_cpu + r["server_cpu_s"] + r["client_cpu_s"]) / args.cores
        r["best_ratio"] = args.in_process_wall / max(args.in_process_wall, floor_wall)
        print(f"on {args.cores} cores the service needs >= {floor_wall:.2f} s where the engine in process "
              f"took {args.in_process_wall:.2f} s: service / in-process <= {r['best_ratio']:.2f}x")
    write_json(args.json, {"args": vars(args), **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
