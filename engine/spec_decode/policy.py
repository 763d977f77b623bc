"""How many draft tokens each decode sequence verifies in a step: the draft length that makes the
step's expected tokens per second largest.

``StepCosts`` holds T(r), the time of a decode step of r query rows on the serving path in use,
measured at start-up (``LLMEngine`` times the runner on synthetic rows) and interpolated between
the measured sizes. A sequence that verifies k drafts adds k rows; with acceptance a per drafted
position it expects 1 + a + ... + a^k tokens from the step. a is the request's running average
for drafts behind a suffix match of that length (``SpecState.acceptance``; a long match is far
surer than a short one). ``allocate`` hands out draft tokens one at a time, each to the sequence
whose next draft adds the most expected tokens, and keeps the count at which the step's expected
tokens per unit of time were largest: a single stream on the CPU, where a few more rows cost
little, drafts up to the cap; a large batch, whose rows already cost in proportion, drafts little
or nothing; a request whose drafts keep failing (acceptance below what a row costs) stops
drafting, which costs nothing.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from kvserve.engine.spec_decode.ngram import NgramIndex

# Before a request has verified drafts behind a match of n tokens, they are expected kept at
# 1 - 0.4 / 2^(n - 2) per position: 0.6 behind 2 matched tokens, 0.8 behind 3, 0.95 behind 5 (a
# miss half as likely per token matched beyond two). Measured on the benchmark's grounded, chat and
# structured prompts (8 each, greedy, bfloat16, every proposal verified at up to 8 drafts): the
# first draft behind a 2-token match kept 109 of 176 times (0.62), behind 5 tokens 123 of 125
# (0.98); behind 3-4 tokens 12 of 17; later positions alike or better. One average for every
# match (as before) let the weak short matches cut the drafts of the sure long ones.
INITIAL_ACCEPTANCE = 0.6  # behind a match of 2 tokens: match_prior(2)


def match_prior(n: int) -> float:
    """Acceptance expected of n-gram drafts behind a suffix match of ``n`` tokens, per position."""
    return max(0.0, 1.0 - 0.4 * 0.5 ** (n - 2))


# A grammar's forced tokens (``structured/drafts.py``) have their own average: the grammar leaves the
# model no other choice for them, so they are kept unless the model spells the forced text with
# other tokens (mostly at the last one, where the forced text meets free text; see
# docs/serving/speculative.md). Measured: 96 of 111 forced positions tried were kept (0.86) on the
# benchmark's 8 structured prompts (greedy, bfloat16).
INITIAL_FORCED_ACCEPTANCE = 0.9
ACCEPTANCE_DECAY = 0.8  # weight of the past in the per-position acceptance average
OBSERVED_STEP = 0.1  # a size's running ratio moves by this fraction x the weight below per step
OBSERVED_QUANTILE = 0.25  # the quantile of the observed ratios it tracks (up by 1/4, down by 3/4)


class StepCosts:
    """T(rows) from measured (rows, seconds) pairs; linear between them and beyond the last;
    refreshed by the steps the engine then runs (``observe``).

    A step of more rows never costs less than one of fewer, so a size measured slower than a
    larger one was slowed by something else (other load only adds time): it takes the larger
    one's time. Without that, one disturbed size near the bottom (measured here once: T(2) = 1.93
    T(1) beside T(3) = 1.49 T(1), int4 weights) made the first draft look like a loss, and a whole
    run drafted nothing.

    The start-up table times rows at a short context, on a machine doing nothing else; a serving
    step's rows attend over the requests' real contexts, beside the front-end. ``observe`` keeps,
    per measured size, a running lower quartile of the ratio of the decode steps' observed time to
    the table's (starting at 1); a size not observed yet takes the ratio of the nearest observed
    size below it, so that verification rows found dearer than the table said make the larger
    sizes dearer too. The policy then stops buying drafts whose rows cost more than measured.
    (Measured, int4, one stream at contexts of ~1,000: c(4) 1.5-1.6 and c(8) 2.4-2.7 observed
    against 1.26 and 1.75 in the table.)"""

    def __init__(self, measured: dict[int, float]):
        if not measured or 1 not in measured:
            raise ValueError("step costs need a measurement at one row")
        self.rows = sorted(measured)
        self.table = self._monotone([max(measured[r], 1e-9) for r in self.rows])
        self.ratios: list[float | None] = [None] * len(self.rows)  # observed / table, per size
        self.seconds = list(self.table)

    @staticmethod
    def _monotone(seconds: list[float]) -> list[float]:
        """Each the least of its own and every larger size's."""
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return seconds

    def observe(self, rows: int, seconds: float) -> None:
        """Fold in a decode step of ``rows`` rows that took ``seconds`` (sizes the table holds)."""
        i = bisect.bisect_left(self.rows, rows)
        if i == len(self.rows) or self.rows[i] != rows or seconds <= 0:
            return
        before = self.ratios[i] if self.ratios[i] is not None else 1.0
        ratio = seconds / self.table[i]
        # a running lower quartile: a step slowed by other load moves it up a third as far as a
        # faster one moves it down, so a burst of load does not read as dearer rows
        move = 0.0 if ratio == before else OBSERVED_QUANTILE if ratio > before else OBSERVED_QUANTILE - 1
        self.ratios[i] = before * (1 + OBSERVED_STEP * move)
        carried, seconds_now = 1.0, []
        for base, observed in zip(self.table, self.ratios, strict=True):
            carried = observed if observed is not None else carried
            seconds_now.append(base * carried)
        self.seconds = self._monotone(seconds_now)

    def __call__(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.rows):  # beyond the largest measured size: the last slope, never below it
            if len(self.rows) == 1:
                return self.seconds[0] * rows
            r0, r1, s0, s1 = self.rows[-2], self.rows[-1], self.seconds[-2], self.seconds[-1]
            return s1 + max(s1 - s0, 0.0) / (r1 - r0) * (rows - r1)
        r0, r1, s0, s1 = self.rows[i - 1], self.rows[i], self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)

    def relative(self) -> dict[int, float]:
        """c(n) = T(n) / T(1) at the measured sizes."""
        return {r: s / self.seconds[0] for r, s in zip(self.rows, self.seconds, strict=True)}


@dataclass
class SpecState:
    """A sequence's speculation: its n-gram index, acceptance averages and counters."""

    index: NgramIndex
    # per drafted position, of n-gram drafts behind a match of n tokens (n: the average; from
    # match_prior(n) until the request verifies such drafts)
    by_match: dict[int, float] = field(default_factory=dict)
    forced_acceptance: float = INITIAL_FORCED_ACCEPTANCE  # of a grammar's forced tokens
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which kept
    steps: int = 0  # verification steps (steps with at least one draft)
    forced: int = 0  # how many of this step's drafts lead with a grammar's forced tokens
    match: int = 0  # the n-gram length behind this step's other drafts

    def acceptance(self, match: int | None = None) -> float:
        """The expected acceptance per position of n-gram drafts behind a match of ``match`` tokens
        (None: this step's)."""
        match = self.match if match is None else match
        return self.by_match.get(match, match_prior(match))

    def rates(self, num_drafts: int) -> list[float]:
        """The expected acceptance of each of this step's drafted positions."""
        forced = min(self.forced, num_drafts)
        return [self.forced_acceptance] * forced + [self.acceptance()] * (num_drafts - forced)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Fold a verification into the counters and the per-position acceptance averages (forced
        positions into ``forced_acceptance``, the others into this step's match length's average):
        each accepted position counts 1, the first rejected one 0; positions after it were not
        tried."""
        self.drafted += num_drafts
        self.accepted += num_accepted
        self.steps += 1
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafts else [])
        d = ACCEPTANCE_DECAY
        for position, x in enumerate(outcomes):
            if position < self.forced:
                self.forced_acceptance = d * self.forced_acceptance + (1 - d) * x
            else:
                self.by_match[self.match] = d * self.acceptance() + (1 - d) * x


def allocate(costs: StepCosts, base_rows: int, candidates: list[tuple[float | list[float], int]],
             max_rows: int | None = None) -> list[int]:
    """Draft tokens per candidate: ``candidates`` are (acceptance, most drafts it may take) of the
    sequences that have drafts, the acceptance one figure or one per drafted position
    (``SpecState.rates``); ``base_rows`` is the step's rows without drafts. The drafts are taken
    in order of expected gain (a draft's gain is the chance that it and the ones before it are
    kept), and the step gets the prefix of that order with the most expected tokens per second,
    within ``max_rows`` rows (None: no limit). The best prefix, not the first that stops gaining:
    step costs have steps and plateaus (the CPU's row blocks), past which more drafts pay again."""
    rates = [[a] * cap if isinstance(a, float | int) else list(a)[:cap] for a, cap in candidates]
    heap: list[tuple[float, int, int]] = []  # (-gain of the next draft, candidate, its position)
    remaining = 0.0  # the gains of every draft not taken yet
    for i, a in enumerate(rates):
        gain = 1.0
        for position, rate in enumerate(a):
            gain *= rate
            remaining += gain
            if position == 0 and gain > 0.0:
                heapq.heappush(heap, (-gain, i, 0))
    expected, rows = float(base_rows), base_rows  # one token per sampling row, before drafts
    best_rate, best_taken, order = expected / costs(rows), 0, []
    while heap and (max_rows is None or rows < max_rows):
        if (expected + remaining) / costs(rows + 1) <= best_rate:
            break  # even every draft left, all kept, would not pay for the next row
        negative, i, position = heapq.heappop(heap)
        expected, remaining, rows = expected - negative, remaining + negative, rows + 1
        order.append(i)
        if position + 1 < len(rates[i]) and rates[i][position + 1] > 0.0:
            heapq.heappush(heap, (negative * rates[i][position + 1], i, position + 1))
        if expected / costs(rows) > best_rate:
            best_rate, best_taken = expected / costs(rows), len(order)
    ks = [0] * len(candidates)
    for i in order[:best_taken]:
        ks[i] += 1
    return ks
