"""The serving benchmark's workload and load generator: random token-id prompts (a concurrency
limit or Poisson arrivals), one gRPC stream per request on the raw stub, and what each request
saw (``Trace``). The benchmark (``bench``), the concurrency sweep (``sweep``), the gRPC floor
(``floor``) and the peers' harness (``benchmarks/peers``, over HTTP too, through ``drive``) all
drive their load through here.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

ENGINE_FLAGS = ("model", "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                "block_size", "max_model_len")


def add_engine_flags(group, dtype: str, model_help: str | None = None) -> None:
    """The ``ENGINE_FLAGS`` as command-line flags of a benchmark that starts a server (bench, peers)."""
    group.add_argument("--model", default="default", help=model_help)
    group.add_argument("--dtype", default=dtype)
    group.add_argument("--device", default="auto")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
        group.add_argument("--" + name.replace("_", "-"), type=int)
    group.add_argument("--kv-cache-memory", type=float)

@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start (rate mode); 0 in concurrency mode


@dataclass
class Trace:
    """What one request saw: send time, the arrival time of each token, end, error."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None


# ---- workload ------------------------------------------------------------------------------
def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def parse_levels(text: str) -> list[int]:
    """"8" or "1,8,32,128": concurrency levels, each >= 1."""
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected N or N,N,... with every N >= 1, got {text!r}")
    return levels


def make_workload(args: argparse.Namespace, seed: int | None = None) -> list[Request]:
    rng = random.Random(args.seed if seed is None else seed)
    lo_tok, hi_tok = args.token_range
    prefix = [rng.randrange(lo_tok, hi_tok) for _ in range(args.prompt_len[1])]
    t = 0.0
    work = []
    for _ in range(args.num_requests):
        n = rng.randint(*args.prompt_len)
        shared = int(n * args.shared_prefix)
        prompt = prefix[:shared] + [rng.randrange(lo_tok, hi_tok) for _ in range(n - shared)]
        if args.request_rate:
            t += rng.expovariate(args.request_rate)
        work.append(Request(prompt, rng.randint(*args.output_len), t))
    return work


# ---- the gRPC run --------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # the sampling of every request unless a caller gives its own


async def drive(work: list[Request], concurrency: int | None, one) -> tuple[list[Trace], float]:
    """The load generator's loop, whatever the protocol: each request sent at its arrival time
    (rate mode) and at most ``concurrency`` in flight (a closed loop: the next one is sent when
    one ends); ``one(req)`` streams one request and returns its ``Trace``."""
    limit = asyncio.Semaphore(concurrency or len(work))
    start = time.perf_counter()

    async def timed(req: Request) -> Trace:
        await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
        async with limit:
            return await one(req)

    traces = await asyncio.gather(*(timed(r) for r in work))
    return list(traces), time.perf_counter() - start


async def run_grpc(target: str, work: list[Request], concurrency: int | None,
                   sampling: dict | None = None) -> tuple[list[Trace], float]:
    from kvserve.clients.aio import AsyncClient
    from kvserve.v1 import llm_pb2_grpc

    async with AsyncClient(target) as client:
        await client.generate(token_ids=work[0].prompt[:8], max_tokens=2)  # warm-up
        stub = llm_pb2_grpc.LLMServiceStub(client.channel)
        return await drive(work, concurrency, lambda req: stream_one(stub, req, sampling))


async def stream_one(stub, req: Request, sampling: dict | None = None) -> Trace:
    """One request on the raw stub: the load generator reads each message and notes the time and
    the token count, nothing more (it shares the CPU with the server it measures). ``sampling``:
    SamplingParams fields (default ``GREEDY``); every request ignores EOS."""
    from kvserve.clients.messages import build_request

    tr = Trace(sent=time.perf_counter())
    call = stub.Stream(build_request(token_ids=req.prompt, max_tokens=req.max_tokens, ignore_eos=True,
                                     **(GREEDY if sampling is None else sampling)))
    times = tr.token_times
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            times.extend([time.perf_counter()] * len(msg.token_ids))
    except grpc.aio.AioRpcError as e:
        tr.error = e.code().name
    tr.end = time.perf_counter()
    return tr


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}


def server_flags(args, num_requests: int) -> list[str]:
    """``kvserve serve`` flags for a server started for the run."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_kwargs(args).items()]
    return [*flags, f"--max-queue={max(256, num_requests)}", f"--stream-interval={args.stream_interval}",
            "--log-level", "warning"]
