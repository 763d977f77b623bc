"""The harness's ``engine`` system: kvserve's engine in the harness's own process, no server, on
the same requests and arrival pattern as the served systems, so that one run prints what the
service keeps of its engine (``kvserve / engine``).

The engine is built from exactly the flags the harness gives ``kvserve serve`` (parsed by the
server's own parser), without detokenizing, as the engine-core process runs it. The loop is the
load generator's, stepped instead of awaited: a closed loop admits the next request when a step
ends with one of its ``concurrency`` finished (sent = then); Poisson arrivals are admitted at the
first step boundary after their arrival time (sent = the arrival time, so the wait for the step
in flight counts, as it does for a served request). Token times are the end of the step that
produced them. What this leaves out is exactly the service: gRPC, the front-end process and its
hand-over to the core, detokenizing, and the client reading the streams.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from kvserve.benchmarks.serving.load import Request, Trace


def engine_config(flags: list[str]):
    """The ``EngineConfig`` that ``kvserve serve FLAGS`` would build."""
    from kvserve.service.cli import add_serve_command
    from kvserve.service.cli import engine_config as config_of

    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers(dest="command"))
    return config_of(parser.parse_args(["serve", *flags]))


class InProcess:
    """One ``LLMEngine`` for every level of a run; ``run_level`` has ``drive``'s results."""

    def __init__(self, flags: list[str], sampling: dict):
        from kvserve.engine.core.llm_engine import LLMEngine
        from kvserve.engine.process.gc_tuning import tune_gc

        self.engine = LLMEngine(engine_config(flags), detokenize=False)
        tune_gc()
        self.sampling = sampling
        self._next_id = 0

    def close(self) -> None:
        self.engine.shutdown()

    def _params(self, max_tokens: int):
        from kvserve.engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **self.sampling)

    def warm_up(self, prompt: list[int]) -> None:
        self.run_level([Request(prompt[:8], 2, 0.0)], 1)

    def run_level(self, work: list[Request], concurrency: int | None) -> tuple[list[Trace], float]:
        engine = self.engine
        traces = [Trace() for _ in work]
        order = deque(sorted(range(len(work)), key=lambda i: work[i].arrival))
        live: dict[str, int] = {}
        start = time.perf_counter()
        while order or live:
            now = time.perf_counter()
            while order and (concurrency is None or len(live) < concurrency) \
                    and start + work[order[0]].arrival <= now:
                i = order.popleft()
                key = f"bench-{self._next_id}"
                self._next_id += 1
                traces[i].sent = now if concurrency is not None else start + work[i].arrival
                engine.add_tokenized(key, work[i].prompt, self._params(work[i].max_tokens))
                live[key] = i
            if not live:  # open loop, nothing in flight: wait for the next arrival
                time.sleep(max(0.0, start + work[order[0]].arrival - time.perf_counter()))
                continue
            outputs = engine.step()
            t = time.perf_counter()
            for key, message in engine.take_rejected():
                if key in live:
                    traces[live.pop(key)].error = f"rejected: {message}"
            for out in outputs:
                i = live.get(out.request_id)
                if i is None:
                    continue
                traces[i].token_times.extend([t] * len(out.new_token_ids))
                if out.finished:
                    traces[i].end = t
                    del live[out.request_id]
        return traces, time.perf_counter() - start
