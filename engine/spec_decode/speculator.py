"""The engine core's side of speculative decoding: drafts before a step, verification after it.

``Speculator.propose`` runs before the scheduler: each running decode sequence that may draft
(the server's mode, the request's ``speculative`` and ``max_draft_tokens``) asks its n-gram index
for candidates, a structured-output sequence its grammar (the forced tokens composed with the
n-gram drafts, every draft allowed by the grammar: ``structured/drafts.py``), and
``policy.allocate`` decides how many of them the step verifies from the step-cost table that
``measure_step_costs`` took at start-up. The scheduler then fits them to the budget and blocks
(``Scheduler._schedule_drafts``). After the model ran, ``runs`` turns the sampled rows into each
sequence's kept tokens (sample-then-match, ``spec_decode/verify.py``) and counts drafted and
accepted tokens, per request and in total.
"""

from __future__ import annotations

import logging
import time

from kvserve.engine.config import EngineConfig
from kvserve.engine.model_input import ModelInput, blocks_for, synthetic_input
from kvserve.engine.sequence import Sequence, SequenceStatus
from kvserve.engine.spec_decode.ngram import NgramIndex
from kvserve.engine.spec_decode.policy import SpecState, StepCosts, allocate
from kvserve.engine.spec_decode.verify import accepted_run

log = logging.getLogger("kvserve.engine.spec_decode")

MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64)
MEASURE_CONTEXT = 128  # context length of the timed rows
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class Speculator:
    """``exact_rows``: where a step of that many decode rows or fewer computes each row as a
    one-row step would (the CPU's fused decode step), drafts never take a step that fits past it,
    so that a batch of up to that many sequences gives the tokens of plain decoding bit for bit
    (None: rows alike at any count). The executor answers it (``exact_rows()``): the core never
    looks at the model's layers or kernels."""

    def __init__(self, config: EngineConfig, costs: StepCosts, exact_rows: int | None = None,
                 observe_costs: bool = False):
        self.exact_rows = exact_rows
        self.observe_costs = observe_costs  # whether decode steps refresh ``costs`` (observe_step)
        self.max_drafts = config.num_speculative_tokens
        # the draft sources of the mode: n-gram drafts (every sequence), forced tokens (constrained ones)
        mode = config.speculative
        self.ngram, self.forced = mode in ("ngram", "all"), mode in ("grammar", "all")
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.costs = costs
        # vLLM's spec-decode counters (kvserve_spec_decode_* in Prometheus)
        self.counters = dict.fromkeys(SPEC_COUNTERS, 0)

    def propose(self, running: list[Sequence], grammar=None) -> None:
        """Set each running sequence's ``draft_token_ids`` for the next step (most get none);
        ``grammar``: the engine's ``StructuredOutput``, which drafts for constrained sequences."""
        candidates: list[tuple[list[float], int]] = []
        drafting: list[tuple[Sequence, list[int]]] = []
        for seq in running:
            seq.draft_token_ids = []
            cap = self._cap(seq)
            decoding = seq.status is SequenceStatus.RUNNING and seq.is_decoding
            constrained = grammar is not None and grammar.is_constrained(seq)
            if not cap or not decoding or not (self.ngram or constrained):
                continue
            if seq.spec is None:
                seq.spec = SpecState(NgramIndex(self.min_n, self.max_n))
            if constrained:
                drafts, seq.spec.forced, seq.spec.match = grammar.draft(
                    seq, cap, seq.spec.index if self.ngram else None, self.forced)
            else:
                (drafts, seq.spec.match), seq.spec.forced = seq.spec.index.propose(seq.token_ids, cap), 0
            if drafts:
                candidates.append((seq.spec.rates(len(drafts)), len(drafts)))
                drafting.append((seq, drafts))
        if not drafting:
            return
        base = len(running)
        cap = self.exact_rows if self.exact_rows is not None and base <= self.exact_rows else None
        for (seq, drafts), k in zip(drafting, allocate(self.costs, base, candidates, cap), strict=True):
            seq.draft_token_ids = drafts[:k]

    def _cap(self, seq: Sequence) -> int:
        p = seq.params
        if p.speculative == "off":
            return 0
        return self.max_drafts if p.max_draft_tokens is None else min(self.max_drafts, p.max_draft_tokens)

    def runs(self, scheduled: list, row_tokens: list[int]) -> list[list[int]]:
        """Per sampling sequence (batch order) the tokens its rows give: one for a plain row, the
        accepted run for a verification; counts what was drafted and kept."""
        runs, i = [], 0
        for s in scheduled:
            if not s.samples:
                continue
            k = len(s.drafts)
            sampled = row_tokens[i : i + k + 1]
            i += k + 1
            if not k:
                runs.append(sampled)
                continue
            run = accepted_run(s.drafts, sampled)
            s.seq.spec.record(k, len(run) - 1)
            self.counters["spec_decode_num_drafts"] += 1
            self.counters["spec_decode_num_draft_tokens"] += k
            self.counters["spec_decode_num_accepted_tokens"] += len(run) - 1
            runs.append(run)
        return runs

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (drafts included) ran its model in ``seconds``."""
        if self.observe_costs:
            self.costs.observe(rows, seconds)

    def stats(self) -> dict:
        return speculation_stats(self.counters)


def speculator_for(config: EngineConfig, executor) -> Speculator | None:
    """The engine's speculator, its step costs measured now through ``executor`` (None when
    speculation is off). Decode steps refresh them on the CPU, where a step's wall time is its
    cost (a GPU step returns before the device is done: the measured table stands there)."""
    if config.speculative == "off":
        return None
    costs = measure_step_costs(executor.execute_model, executor.num_kv_blocks, config.block_size,
                               config.max_num_batched_tokens)
    return Speculator(config, costs, exact_rows=executor.exact_rows(),
                      observe_costs=executor.device.type == "cpu")


def speculation_stats(counters: dict | None) -> dict:
    """The Stats keys of speculative decoding from a speculator's counters (zeros when it is off)."""
    c = counters or dict.fromkeys(SPEC_COUNTERS, 0)
    drafts, tokens, accepted = (c[name] for name in SPEC_COUNTERS)
    return {**c,
            "spec_decode_acceptance_rate": accepted / tokens if tokens else 0.0,
            # tokens a verification step emits per sequence, the bonus token included
            "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}


def spec_usage(seq: Sequence) -> tuple[int, int]:
    """(draft tokens verified, of which accepted) for a sequence so far."""
    return (seq.spec.drafted, seq.spec.accepted) if seq.spec is not None else (0, 0)


def measure_step_costs(execute, num_kv_blocks: int, block_size: int, max_rows: int) -> StepCosts:
    """T(rows) of decode steps of 1..64 rows (as far as the cache and the budget allow) through
    ``execute`` (the executor's ``execute_model``): rows of one synthetic sequence at positions
    MEASURE_CONTEXT.., written into the first blocks of the still empty cache. A warm-up round,
    then 3 rounds over every size in turn (a burst of other load then hits every size alike), and
    the fastest time of each size (others' load only adds time)."""
    context = min(MEASURE_CONTEXT, num_kv_blocks * block_size // 2)
    sizes = [r for r in MEASURED_ROWS if r <= max_rows and context + r <= num_kv_blocks * block_size]
    inputs = {rows: _synthetic_rows(context, rows, block_size) for rows in sizes}
    measured = dict.fromkeys(sizes, float("inf"))
    for round_ in range(4):
        for rows, inp in inputs.items():
            t0 = time.perf_counter()
            logits = execute(inp)
            if logits is not None:
                logits[-1, 0].item()  # wait for the device
            if round_:
                measured[rows] = min(measured[rows], time.perf_counter() - t0)
    costs = StepCosts(measured)
    log.info("speculative decoding: c(n) = %s",
             ", ".join(f"{r}:{c:.2f}" for r, c in costs.relative().items()))
    return costs


def _synthetic_rows(context: int, rows: int, block_size: int) -> ModelInput:
    """Decode rows of one sequence at positions context.., over blocks numbered from 0 (and, for a
    model with a recurrent state, state slot 0: the rows are timed as the one verification they are)."""
    table = list(range(blocks_for(context + rows, block_size)))
    inp = synthetic_input([(p, 1) for p in range(context, context + rows)], [table] * rows, block_size)
    inp.state_slots = [0] * rows
    return inp
