"""The tenants benchmark's flood against an interactive client, simulated: the real scheduler and block
manager, every sampled token fixed, no model; a synthetic machine (``c0 + a * tokens + b * pairs``
seconds a step) that the scheduler's step time model learns, and a clock advanced by it (model
seconds: no client, gRPC or wall time). Used by tests/engine/tenancy/test_due_bound.py and for the
simulation tables of docs/performance/tenants.md.

The benchmark's shape by default: 64 flood sequences of one 1,024-token prompt (its 4 calls of n=16),
block size 16, budget 2,048, a 0.5 s step bound (the CPU's default); 40 interactive requests of a
24-token prompt and 16 tokens. The first request arrives ``first_at`` of the way into a step once the
flood decodes alone; each next one ``think`` model seconds after the last one ended (the client's
round trip). A request that arrives while a step runs waits for it (the engine core takes new work
between steps), and its TTFT counts from its arrival. Recorded per step (``Step``) and per request
(``Request``): the step in flight when it arrived and why that step was as long as it was.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.scheduler import Scheduler
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence, Tenancy
from kvserve.engine.tenancy.shares import TenantShares

MACHINE = (0.02, 0.0004, 1.8e-6)  # fitted to the quiet Zen 4 figures (docs/performance/tenants.md)
SHORT = [5, 6, 7, 8] * 6  # the interactive prompt: 24 tokens


@dataclass
class Step:
    start: float
    seconds: float
    kind: str  # "alone" (nothing cut), "held" (a light first token due), "progress", "cut" (light decodes)
    flood_rows: int  # flood decode rows run
    flood_decoding: int  # flood sequences with a token to decode
    flood_prefill: int  # flood prompt tokens computed (recomputes after preemption)
    light_tokens: int  # interactive tokens computed


@dataclass
class Request:
    seq: Sequence
    arrival: float
    in_flight: int  # the step that ran when it arrived (it waits for its end)
    first: float | None = None
    admitted: int | None = None  # the step that computed its prompt

    @property
    def ttft(self) -> float:
        return self.first - self.arrival


class Flood:
    def __init__(self, policy="fair", requests=40, think=0.01, linger=0.25, cost=0.05, seqs=64, prompt=1024,
                 tokens=1024, light_tokens=16, blocks=8192, budget=2048, block_size=16, max_step_time=0.5,
                 machine=MACHINE, first_at=0.5, warmup=30, noise=0.0, seed=0, prefill_pair=None):
        self.machine, self.think, self.first_at, self.warmup = machine, think, first_at, warmup
        # seconds a query-key pair of a prefill chunk costs (None: as a decode row's, the machine's b)
        self.prefill_pair = prefill_pair
        self.noise, self.random = noise, random.Random(seed)  # each step off by up to +-noise at random
        self.requests, self.light_tokens = requests, light_tokens
        self.shares = TenantShares(policy, row_cost=cost, linger=linger)
        self.s = Scheduler(BlockManager(blocks, block_size, True), seqs, budget, prompt + tokens + 64, [0],
                           max_step_time=max_step_time, shares=self.shares)
        self.now = 0.0
        self.shares.rows.clock = lambda: self.now
        ids = list(range(1000, 1000 + prompt))
        self.flood = [Sequence(f"flood-{i}", list(ids), SamplingParams(max_tokens=tokens, ignore_eos=True),
                               Tenancy("flood")) for i in range(seqs)]
        for seq in self.flood:
            self.s.add(seq)
        self.steps: list[Step] = []
        self.reqs: list[Request] = []
        self.flood_tokens: list[int] = []  # flood tokens sampled per step

    def run(self, until: float | None = None):
        """Until every interactive request ended (or, with ``until``, that many model seconds)."""
        s, rows, current, arrival = self.s, self.shares.rows, None, None
        params = SamplingParams(max_tokens=self.light_tokens, ignore_eos=True)

        def more() -> bool:
            return len(self.reqs) < self.requests

        def going() -> bool:
            return self.now < until if until is not None else more() or current is not None

        while s.has_unfinished() and going():
            if current is None and arrival is not None and arrival <= self.now and more():
                seq = Sequence(f"interactive-{len(self.reqs)}", list(SHORT), params, Tenancy("interactive"))
                s.add(seq)
                current = Request(seq, arrival, len(self.steps) - 1)
                self.reqs.append(current)
            decoding = {q.seq_id for q in s.running
                        if q.tenancy.tenant == "flood" and q.num_tokens - q.num_computed_tokens == 1}
            out = s.schedule()
            pairs, decode = out.attended_pairs, out.decode_pairs  # (before postprocess advances the counts)
            dt = self.seconds(out) * (1 + self.noise * (2 * self.random.random() - 1))
            kind = ("progress" if rows.progress else "held" if rows.due_left is not None
                    else "cut" if rows.held else "alone")
            flood = [x for x in out.scheduled if x.seq.tenancy.tenant == "flood"]
            light = sum(x.num_tokens for x in out.scheduled if x.seq.tenancy.tenant == "interactive")
            rows_run = sum(x.seq.seq_id in decoding for x in flood)
            prefill = sum(x.num_tokens for x in flood if x.seq.seq_id not in decoding)
            self.steps.append(Step(self.now, dt, kind, rows_run, len(decoding), prefill, light))
            if current is not None and current.admitted is None and light:
                current.admitted = len(self.steps) - 1
            self.now += dt
            s.postprocess(out, [7] * len(out.sampling_seqs))
            s.step_clock.observe(out.num_tokens, pairs, dt, decode)
            self.flood_tokens.append(sum(q.tenancy.tenant == "flood" for q in out.sampling_seqs))
            if arrival is None and len(self.steps) > self.warmup and len(decoding) == len(self.flood):
                arrival = self.now + self.first_at * dt  # into the next step, first_at of the way
            if current is not None and current.first is None and current.seq.num_completion_tokens:
                current.first = self.now
            if current is not None and current.seq.is_finished:
                current, arrival = None, self.now + self.think
        s.bm.check_integrity()
        return self

    def seconds(self, out) -> float:
        """Model seconds of the step ``out`` on the synthetic machine."""
        c0, a, b = self.machine
        pairs = out.attended_pairs
        if self.prefill_pair is None:
            return c0 + a * out.num_tokens + b * pairs
        decode = out.decode_pairs
        return c0 + a * out.num_tokens + b * decode + self.prefill_pair * (pairs - decode)

    def flood_rate(self, start: float, end: float) -> float:
        """Flood tokens per model second over the steps that started in [start, end)."""
        kept = [(st.seconds, n) for st, n in zip(self.steps, self.flood_tokens, strict=True)
                if start <= st.start < end]
        return sum(n for _, n in kept) / sum(t for t, _ in kept)

    def window(self) -> tuple[float, float]:
        """From the first request's arrival to the last one's end (the benchmark's window)."""
        return self.reqs[0].arrival, self.steps[-1].start + self.steps[-1].seconds

    def alone(self, prompt: int) -> float:
        """Model seconds of a step holding only a ``prompt``-token prefill (the light work's step alone)."""
        c0, a, b = self.machine
        return c0 + a * prompt + b * prompt * (prompt + 1) / 2


def table(thinks=(0.01, 0.1, 0.3, 0.6), lingers=(0.25, 1.0)) -> None:
    """docs/performance/tenants.md's simulation table: per think time and linger, the interactive TTFT
    p50, the first, the worst of the rest (and the step it arrived into), and the flood's tokens per
    model second against fcfs over the same window (``python tests/engine/tenancy/flood_sim.py``)."""
    print("| think, linger | p50 | first | worst of the rest (step in flight) | flood tok/s | fcfs | ratio |")
    for think in thinks:
        for linger in lingers:
            run = Flood(think=think, linger=linger).run()
            ttft = sorted(r.ttft for r in run.reqs)
            start, end = run.window()
            fair = run.flood_rate(start, end)
            fcfs = Flood("fcfs", requests=0).run(until=end).flood_rate(start, end)
            worst = max(run.reqs[1:], key=lambda r: r.ttft)
            step = run.steps[worst.in_flight]
            print(f"| {think} s, {linger} s | {ttft[len(ttft) // 2] * 1e3:.0f} ms "
                  f"| {run.reqs[0].ttft * 1e3:.0f} ms | {worst.ttft * 1e3:.0f} ms ({step.kind}, "
                  f"{step.seconds * 1e3:.0f} ms) | {fair:.0f} | {fcfs:.0f} | {fair / fcfs:.3f} |")


if __name__ == "__main__":
    table()
