"""kvserve against vLLM and llama-server, served, on the same requests
(``python -m kvserve.benchmarks.peers``; docs/performance/peers.md).

    python -m kvserve.benchmarks.peers --systems kvserve,vllm,llama.cpp --concurrency 1,8,32,64 \\
        --rates 1,2,4 --num-requests 96 --prompt-len 64:400 --output-len 128 --temperature 0.6 \\
        --dtype bfloat16 --json peers.json --plot peers.png

The systems run one after the other, never two at once: each server is started on a free
loopback port, warmed up with one short request, measured at every level, and stopped before
the next one starts. kvserve streams over gRPC (``Stream``), vLLM over its OpenAI
``/v1/completions`` and llama-server over its ``/completion`` (both Server-Sent Events), each with
the same load generator (``benchmarks/serving/load.py``'s ``drive``): a closed loop at each
``--concurrency`` level, then Poisson arrivals at each ``--rates`` level. Level i's requests are
the same for every system and differ from other levels' (seed + i), so no level finds an earlier
level's prompts in a prefix cache. Printed: per system and level output tokens/s, TTFT and
inter-token latency p50/p99 and errors, then kvserve's ratio to each peer. The ``engine`` system
is kvserve's engine stepped in the harness's process on the same requests and arrivals, no server
(``benchmarks/instruments/in_process.py``): ``kvserve / engine`` is what the service keeps of its
engine. ``--rounds N`` runs the systems N times on the same requests, in turn forwards and
backwards (kvserve, vllm, vllm, kvserve, ...), and ends with each ratio's median over the rounds
and its range: a shared machine whose speed drifts over minutes moves one round's ratios, and
alternating gives each system the same share of the slow and the fast minutes. The peers are
set up once by ``make bench-peers``; ``--systems kvserve,engine`` needs no peer (the test runs
it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
import time
from types import SimpleNamespace

from kvserve.benchmarks import write_json
from kvserve.benchmarks.peers import dialects, servers, setup
from kvserve.benchmarks.peers.table import (
    HEADER,
    level_label,
    print_median_ratios,
    print_ratios,
    print_table,
    row,
)
from kvserve.benchmarks.serving.load import (
    Request,
    add_engine_flags,
    drive,
    make_workload,
    parse_levels,
    parse_range,
    run_grpc,
    server_flags,
)
from kvserve.benchmarks.serving.report import summarize

SYSTEMS = ("kvserve", "engine", "vllm", "llama.cpp")  # engine: kvserve's engine in process, no server


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SYSTEMS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SYSTEMS)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_rates(text: str) -> list[float]:
    """"1,2,4" (requests/s, each > 0), or "" / "none" for no open-loop levels."""
    if text.strip().lower() in ("", "none"):
        return []
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"expected R or R,R,... with every R > 0, or none; got {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=parse_systems, default=list(SYSTEMS), metavar="S[,S...]",
                   help=f"which of {','.join(SYSTEMS)} to run, in this order")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 8, 32, 64], metavar="N[,N...]",
                   help="closed-loop levels: requests in flight at once")
    p.add_argument("--rates", type=parse_rates, default=[1.0, 2.0, 4.0], metavar="R[,R...]",
                   help="open-loop levels: Poisson arrivals per second ('none' for none)")
    p.add_argument("--num-requests", type=int, default=96, help="requests per level")
    p.add_argument("--prompt-len", type=parse_range, default=(64, 400), metavar="LO:HI")
    p.add_argument("--output-len", type=parse_range, default=(128, 128), metavar="LO:HI")
    p.add_argument("--temperature", type=float, default=0.6, help="the same plain sampling for every system")
    p.add_argument("--token-range", type=parse_range, default=(1000, 30000), metavar="LO:HI",
                   help="prompt token ids are drawn from [LO, HI)")
    p.add_argument("--shared-prefix", type=float, default=0.0, help="share of each prompt that is common")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, in turn forwards and backwards; the ratios' "
                        "medians over the rounds end the output")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--plot", metavar="FILE.png", help="draw output tokens/s against TTFT p99 (goodput)")
    p.add_argument("--peers-dir", help="where the peers are set up (default $KVSERVE_PEERS_DIR or "
                                       "~/.cache/kvserve-peers)")
    p.add_argument("--llama-gguf", help="the GGUF llama-server loads (default: the bundled model's)")
    p.add_argument("--vllm-model", help="the Hugging Face directory vLLM loads (default: the bundled model "
                   "converted by setup)")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--vllm-dtype", help="vLLM's dtype (default: --dtype); on a CPU without AVX-512 vLLM's "
                                        "float32 beats its bfloat16, so each system runs in its best")
    e = p.add_argument_group("kvserve's server (--dtype also vLLM's unless --vllm-dtype)")
    add_engine_flags(e, "bfloat16", model_help="kvserve's model; the peers serve the bundled one")
    e.add_argument("--stream-interval", type=int, default=1)
    e.add_argument("--kvserve-flags", default="", help="more `kvserve serve` flags, as one string")
    return p


def levels_of(args: argparse.Namespace) -> list[dict]:
    return ([{"kind": "concurrency", "value": c} for c in args.concurrency]
            + [{"kind": "rate", "value": r} for r in args.rates])


def workloads(args: argparse.Namespace, levels: list[dict]) -> list[list[Request]]:
    """Level i's requests (seed + i); arrival times for the Poisson levels."""
    out = []
    for i, level in enumerate(levels):
        rate = level["value"] if level["kind"] == "rate" else None
        out.append(make_workload(SimpleNamespace(**{**vars(args), "request_rate": rate}), seed=args.seed + i))
    return out


def check_peers(args: argparse.Namespace) -> setup.PeerPaths:
    """The peers' folder; exits naming what is missing and how to set it up."""
    paths = setup.peers_dir(args.peers_dir)
    peers = [s for s in args.systems if s not in ("kvserve", "engine")]
    own = {"llama.cpp": args.llama_gguf, "vllm": args.vllm_model}  # a peer given the model's files
    if args.model != "default" and not all(own[s] for s in peers):
        raise SystemExit("the peers serve the bundled model unless given theirs (--llama-gguf, "
                         "--vllm-model): leave --model at default, give each peer its files, or run "
                         "--systems kvserve")
    lacking = {s: setup.missing(s, paths, own[s] is not None) for s in peers}
    lacking = {s: what for s, what in lacking.items() if what}
    if lacking:
        lines = [f"  {s}: missing {', '.join(what)}" for s, what in lacking.items()]
        raise SystemExit("\n".join(["peers not set up:", *lines, f"set them up once with: {setup.SETUP_HINT}",
                                    "or run kvserve alone: --systems kvserve"]))
    return paths


@contextlib.contextmanager
def started(system: str, args: argparse.Namespace, paths: setup.PeerPaths):
    """The system's server, up and warmed; yields ``run_level(work, concurrency)``, a coroutine
    function returning (traces, wall seconds)."""
    t = args.temperature
    if system == "kvserve":
        from kvserve.testing.process import ServerProcess

        flags = [*server_flags(args, args.num_requests), *shlex.split(args.kvserve_flags)]
        with ServerProcess(*flags) as server:  # run_grpc warms up at every level
            sampling = dialects.sampling_fields(t)
            yield lambda work, c: run_grpc(server.target, work, c, sampling)
        return
    if system == "engine":
        from kvserve.benchmarks.instruments.in_process import InProcess

        engine = InProcess([*server_flags(args, args.num_requests), *shlex.split(args.kvserve_flags)],
                           dialects.sampling_fields(t))
        try:
            async def run_level(work, c):  # run_system awaits it; the engine steps synchronously
                engine.warm_up(work[0].prompt)
                return engine.run_level(work, c)
            yield run_level
        finally:
            engine.close()
        return
    if system == "vllm":
        model = args.vllm_model or paths.hf_model
        dtype = args.vllm_dtype or args.dtype
        srv = servers.vllm_server(paths.vllm_python, model, dtype, dialects.VLLM_MODEL_NAME,
                                  args.server_timeout)
        stream = dialects.stream_vllm
    else:
        from kvserve.engine.model_loader.source import resolve_model

        per_slot = servers.slot_context(args.prompt_len[1], args.output_len[1])
        srv = servers.llama_server(paths.llama_server, args.llama_gguf or resolve_model("default").gguf_path,
                                   max(args.concurrency), per_slot, args.server_timeout)
        stream = dialects.stream_llama
    with srv:
        print(f"{system}: {' '.join(srv.argv)} (log {srv.log_path})", flush=True)
        one = lambda req: stream(srv.host, srv.port, req, t)
        warm = asyncio.run(one(Request(list(range(1000, 1008)), 2, 0.0)))
        if warm.error or not warm.token_times:
            raise RuntimeError(f"{system}'s warm-up request failed ({warm.error or 'no tokens'}):\n"
                               f"{srv.log_tail()}")
        yield lambda work, c: drive(work, c, one)


def busy_cpus(window_s: float = 2.0) -> float:
    """CPUs' worth of work the machine did over the last ``window_s`` seconds, read from /proc/stat
    while no system of ours runs. (The load average would still count the previous system's run.)"""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all jiffies, idle + iowait
    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    cpus = len(os.sched_getaffinity(0))
    return cpus * (1 - (idle1 - idle0) / max(1, total1 - total0))


def run_system(system: str, args, paths, levels: list[dict], works: list[list[Request]]) -> dict:
    busy = busy_cpus()
    quiet = "" if busy < 0.2 else "  (not quiet: another job shares the CPUs, the figures will suffer)"
    print(f"\n== {system}: {busy:.2f} CPUs busy before it started{quiet}\n{HEADER}", flush=True)
    runs = []
    try:
        with started(system, args, paths) as run_level:
            for level, work in zip(levels, works, strict=True):
                concurrency = level["value"] if level["kind"] == "concurrency" else None
                runs.append(summarize(*asyncio.run(run_level(work, concurrency))))
                print(row(system, level, runs[-1]), flush=True)
    except Exception as e:  # a peer that fails is reported; the others still run
        print(f"{system} failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return {"levels": runs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.shared_prefix <= 1.0:
        raise SystemExit(f"--shared-prefix must be in [0, 1], got {args.shared_prefix}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    paths = check_peers(args)
    levels = levels_of(args)
    works = workloads(args, levels)
    workload = (f"{args.num_requests} requests a level, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, "
                f"output {args.output_len[0]}-{args.output_len[1]} tokens, temperature {args.temperature:g}, "
                f"{args.dtype}" + (f" (vLLM {args.vllm_dtype})" if args.vllm_dtype else ""))
    print(f"peers: {', '.join(args.systems)}; {workload}; levels {' '.join(map(level_label, levels))}")
    result = {"workload": workload, "levels": levels, "systems": {}, "rounds": [],
              "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"\n==== round {i + 1} of {args.rounds}", flush=True)
        order = args.systems if i % 2 == 0 else args.systems[::-1]
        ran = {system: run_system(system, args, paths, levels, works) for system in order}
        one = {**result, "systems": {system: ran[system] for system in args.systems}}
        print_table(one)
        result["rounds"].append({"systems": one["systems"], "ratios": print_ratios(one)})
    result["systems"], result["ratios"] = result["rounds"][0]["systems"], result["rounds"][0]["ratios"]
    if args.rounds > 1:
        result["median_ratios"] = print_median_ratios(levels, [r["ratios"] for r in result["rounds"]])
    write_json(args.json, result)
    if args.plot:
        from kvserve.benchmarks.peers.table import plot_goodput

        plot_goodput(result, args.plot)
        print(f"figure: {args.plot}")
    return 0 if all("levels" in r for one in result["rounds"] for r in one["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
