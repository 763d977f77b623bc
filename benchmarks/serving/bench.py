"""Serving benchmark: a load generator over gRPC, and the same workload through the
in-process engine, so that the service's overhead shows as a ratio measured in one run.

    python -m kvserve.benchmarks.serving --num-requests 32 --concurrency 8 \
        --prompt-len 32:256 --output-len 64 --dtype bfloat16
    python -m kvserve.benchmarks.serving --target 127.0.0.1:50051 --request-rate 4 --no-compare

Without --target it starts a server (``kvserve serve`` on a free loopback port, with the
engine flags given here), runs the load, stops it, then loads the engine in process and
runs the same workload with the same arrival policy (concurrency limit or Poisson rate).
``--rounds N`` keeps both loaded and alternates their runs N times instead (a fresh workload
each round), printing each round's ratios and their median: on a machine whose speed drifts
between minutes, only runs seconds apart compare.

Prompts are random token ids (``--token-range``); ``--shared-prefix F`` makes the first F of
every prompt one common prefix (prefix caching). Every request ignores EOS, so each makes
exactly its output length. Printed: output tokens/s, requests/s, TTFT, inter-token latency
(ITL) and end-to-end latency p50/p90/p99, errors by status code, and service / in-process ratios.
Also the CPU seconds spent per 1,000 streamed tokens: by the server's processes (front-end,
engine core, workers; when the benchmark started the server) and by the in-process engine,
the load generator's own CPU seconds (it shares the machine with the server),
and the in-process engine's host time per step beside the model's forward pass.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import deque

from kvserve.benchmarks import write_json
from kvserve.benchmarks.instruments.procfs import process_tree_cpu_s
from kvserve.benchmarks.serving.load import (
    Request,
    Trace,
    add_engine_flags,
    engine_kwargs,
    make_workload,
    parse_levels,
    parse_range,
    run_grpc,
    server_flags,
)
from kvserve.benchmarks.serving.report import print_ratios, print_report, summarize


# ---- the in-process run --------------------------------------------------------------------
def run_in_process(engine, work: list[Request], concurrency: int | None) -> tuple[list[Trace], float]:
    from kvserve.engine.sampling_params import SamplingParams

    engine.add_request("warmup", work[0].prompt[:8], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    traces = [Trace() for _ in work]
    pending = deque(range(len(work)))
    active: set[str] = set()
    timer = _StepTimer(engine)
    start = time.perf_counter()
    while pending or active:
        now = time.perf_counter()
        while pending and _may_admit(work[pending[0]], len(active), concurrency, now - start):
            i = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=work[i].max_tokens, ignore_eos=True)
            engine.add_request(str(i), work[i].prompt, params)
            traces[i].sent = now
            active.add(str(i))
        if not active:
            time.sleep(max(0.0, start + work[pending[0]].arrival - time.perf_counter()))
            continue
        outputs = timer.step(len(active))
        now = time.perf_counter()
        for out in outputs:
            tr = traces[int(out.request_id)]
            tr.token_times.extend([now] * len(out.new_token_ids))
            if out.finished:
                tr.end = now
                active.discard(out.request_id)
    timer.report()
    return traces, time.perf_counter() - start


class _StepTimer:
    """Wall time of each engine step and of its forward pass (``executor.execute_model``); the
    difference is the host's work per step (scheduling, inputs, sampling, detokenization)."""

    def __init__(self, engine):
        self._engine = engine
        self._forward = 0.0
        self.by_batch: dict[int, list[tuple[float, float]]] = {}
        run = engine.executor.execute_model

        def timed(inp):
            t0 = time.perf_counter()
            out = run(inp)
            if getattr(out, "device", None) is not None and out.device.type == "cuda":
                import torch

                torch.cuda.synchronize()
            self._forward += time.perf_counter() - t0
            return out

        engine.executor.execute_model = timed

    def step(self, batch: int):
        self._forward = 0.0
        t0 = time.perf_counter()
        outputs = self._engine.step()
        self.by_batch.setdefault(batch, []).append((time.perf_counter() - t0, self._forward))
        return outputs

    def report(self) -> None:
        del self._engine.executor.execute_model  # the instance attribute: the method is back
        batch = max(self.by_batch, key=lambda b: (len(self.by_batch[b]), b))
        steps = sorted(self.by_batch[batch])
        step_ms, fwd_ms = (1000 * steps[len(steps) // 2][i] for i in (0, 1))
        print(f"in-process steps at batch {batch} ({len(steps)} of them): median step {step_ms:.2f} ms, "
              f"its forward pass {fwd_ms:.2f} ms, host work {step_ms - fwd_ms:.2f} ms")


def _may_admit(req: Request, num_active: int, concurrency: int | None, elapsed: float) -> bool:
    if concurrency is not None:
        return num_active < concurrency
    return req.arrival <= elapsed


# ---- main ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="an already running server (default: start one)")
    p.add_argument("--num-requests", type=int, default=32)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=parse_levels, metavar="N[,N...]",
                      help="requests in flight at once (default 8); a list (1,8,32,128) runs a sweep "
                           "over one server, service only")
    mode.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead")
    p.add_argument("--prompt-len", type=parse_range, default=(32, 256), metavar="LO:HI")
    p.add_argument("--output-len", type=parse_range, default=(64, 64), metavar="LO:HI")
    p.add_argument("--shared-prefix", type=float, default=0.0, help="share of each prompt that is common")
    p.add_argument("--token-range", type=parse_range, default=(1000, 30000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compare", action="store_true", help="skip the in-process run")
    p.add_argument("--rounds", type=int, default=1,
                   help="N > 1: keep the server and the in-process engine loaded and alternate their runs "
                        "N times (a fresh workload each round); prints each round's ratios and the median")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="the started server's --stream-interval (a message per N tokens; ITL then counts "
                        "the tokens of one message as arriving together)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--plot", metavar="FILE.png", help="draw throughput and TTFT/ITL against concurrency")
    add_engine_flags(p.add_argument_group("engine (for the started server and the in-process engine)"),
                     "auto")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.shared_prefix <= 1.0:
        raise SystemExit(f"--shared-prefix must be in [0, 1], got {args.shared_prefix}")
    if args.plot and args.request_rate:
        raise SystemExit("--plot draws a concurrency sweep; it does not go with --request-rate")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and (args.target or args.no_compare):
        raise SystemExit("--rounds alternates a started server with the in-process engine: it goes with "
                         "neither --target nor --no-compare")
    work = make_workload(args)
    if (args.concurrency and len(args.concurrency) > 1) or args.plot:
        from kvserve.benchmarks.serving.sweep import run_sweep

        return run_sweep(args, work, args.concurrency or [8])
    concurrency = None if args.request_rate else (args.concurrency or [8])[0]
    mode = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {concurrency}"
    interval = f", server --stream-interval {args.stream_interval}" if args.stream_interval > 1 else ""
    print(f"workload: {len(work)} requests, {mode}, prompt {args.prompt_len}, output {args.output_len}, "
          f"shared prefix {args.shared_prefix}{interval}")
    if args.rounds > 1:
        results = _alternating(args, concurrency)
    elif args.target:
        results = {"service": _service_run(args.target, None, work, concurrency)}
    else:
        from kvserve.testing.process import ServerProcess

        with ServerProcess(*server_flags(args, len(work))) as server:
            service = _service_run(server.target, server.proc.pid, work, concurrency)
        results = {"service": service}
        if not args.no_compare:  # loaded after the server stopped: the two never compete for the CPU
            engine = _load_engine(args)
            try:
                local = _local_run(engine, work, concurrency)
            finally:
                engine.shutdown()
            results = _compared(service, local)
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "json"}, **results})
    return 0


def _alternating(args, concurrency) -> dict:
    """``--rounds N``: the server and the in-process engine both loaded (the server first, so that
    it sizes its KV cache as it would alone), their runs alternating round by round, each round
    on a fresh workload (seed + round: no prefix-cache hits from an earlier round). On a machine
    whose speed drifts by the minute, the ratio of runs seconds apart is what means something;
    the median ratio over the rounds is printed at the end. One side idles while the other runs."""
    from kvserve.testing.process import ServerProcess

    rounds = []
    with ServerProcess(*server_flags(args, args.num_requests)) as server:
        engine = _load_engine(args)
        try:
            for i in range(args.rounds):
                work = make_workload(args, seed=args.seed + i)
                print(f"\n---- round {i + 1} of {args.rounds}")
                service = _service_run(server.target, server.proc.pid, work, concurrency)
                rounds.append(_compared(service, _local_run(engine, work, concurrency)))
        finally:
            engine.shutdown()
    median = {k: statistics.median(r["ratio"][k] for r in rounds) for k in rounds[0]["ratio"]}
    print(f"\n== median over {args.rounds} rounds: throughput {median['output_tokens_per_s']:.3f}x   "
          f"TTFT p50 {median['ttft_p50']:.3f}x   ITL p50 {median['itl_p50']:.3f}x")
    return {"rounds": rounds, "ratio": median}


def _compared(service: dict, local: dict) -> dict:
    """The in-process run's report and the ratios, printed (the service's came out after its run);
    the three as the JSON keeps them."""
    print_report("in-process engine", local)
    return {"service": service, "in_process": local, "ratio": print_ratios(service, local)}


def _service_run(target: str, server_pid: int | None, work, concurrency) -> dict:
    """The gRPC run's summary, with the server's CPU seconds when ``server_pid`` is ours."""
    cpu0, own0 = process_tree_cpu_s(server_pid) if server_pid else None, time.process_time()
    traces, wall_s = asyncio.run(run_grpc(target, work, concurrency))
    cpu1, own1 = process_tree_cpu_s(server_pid) if server_pid else None, time.process_time()
    cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    result = {**summarize(traces, wall_s), "cpu_s": cpu_s, "cpu_label": "server processes",
              "load_generator_cpu_s": own1 - own0}
    print_report("service (gRPC)", result)
    return result


def _load_engine(args):
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.core.llm_engine import LLMEngine

    # as a library user gets it: the collector tuning of the server's processes (gc_tuning.py)
    # is theirs alone, since a frozen heap would keep a discarded engine's model alive
    return LLMEngine(EngineConfig(**engine_kwargs(args)))


def _local_run(engine, work, concurrency) -> dict:
    cpu0 = time.process_time()
    traces, wall_s = run_in_process(engine, work, concurrency)
    return {**summarize(traces, wall_s), "cpu_s": time.process_time() - cpu0, "cpu_label": "this process"}
