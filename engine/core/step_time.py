"""A step as the scheduler plans it (``SchedulerOutput``: each sequence's tokens and drafts), and
how long a step will take, learned from the steps that ran: the scheduler's time bound.

A token budget alone does not bound a step's time: a chunk late in a long prompt attends to
every key before it, so 512 tokens at position 8,000 cost several times what they cost at
position 0, and a slower (or busier) machine takes longer for the same tokens. Every running
stream waits for the whole step, so the step's time is the gap between its tokens.

The model is linear in three features of a step: a fixed part, the tokens computed (the
projections and the MLP, per token), and the query-key pairs attended (each new token against
every key up to its own position):

    seconds ~= c0 + a * tokens + b * pairs

The pairs of decode rows are fitted apart from those of prefill chunks: a decode row reads its
whole context's keys and values for one query (bound by memory), a chunk reuses each key for many
queries, so on a CPU a decode row's pair cost several times a chunk's. With one ``b`` for both, a
fit over a flood's prefill steps and then its decode steps priced its decode rows low and put their
cost into ``c0`` (docs/performance/tenants.md: every held step then kept the whole flood). ``coef``
is ``(c0, a, b)`` with a prefill pair's ``b`` (how prefill chunks are sized), ``row_coef`` the same
with a decode pair's (how decode rows are priced); each stands in for the other until its kind of
pair has been seen.

fitted by least squares over the recent steps (older ones weigh less, so the fit follows the
machine's speed), after every step the engine runs. The scheduler asks it how many prefill
tokens still fit under ``max_step_time`` at a given position, and no fewer than make the fixed
part a small share of a step that prefills (``chunk_floor``: a large model's fixed part is a
large share of a short step). Until ``MIN_STEPS`` steps have been
seen (too few to tell the three parts apart) it bounds with one part, seconds per token fitted
through the origin: a step's fixed part is then charged to its tokens, which overstates what
further tokens cost, so the first steps err on the short side. Without that, a burst that comes
right after start-up ran its first steps unbounded (a 48-prompt burst at budget 2048: 2 s gaps).
Plain Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from kvserve.engine.sequence import Sequence

MIN_STEPS = 8  # steps seen before the three-part fit (before it: seconds per token alone)
MIN_PREFILL_CHUNK = 32  # prefill tokens a step may always take: waiting prompts always progress
# ... and at least as many as make the step's fixed part (the fitted c0: the weights read once, the
# panels unpacked, the step's Python) at most FIXED_SHARE of the step's predicted time. A small
# model's c0 is tens of ms and the bound's chunks are far larger, so nothing changes there; a
# 1.7B model on two cores has a c0 of ~0.1-0.3 s, and a 500 ms bound would otherwise cut its
# prompts into chunks of a few dozen tokens whose steps are mostly that fixed part
# (docs/performance/gguf_kquants.md, "What the step bound costs a large model"). 0: no such floor.
FIXED_SHARE = 0.2
# While prompts wait, the running decodes take at most DECODE_SHARE of a step that prefills: a
# step's bound stretches to decode time / DECODE_SHARE (at most MAX_STRETCH times the configured
# bound). Every waiting prompt pays each decode pass that runs before its chunk, so bursts of prompts
# beside many streams wait far longer without it (docs/performance/tuning.md has the figures). With
# few decodes (light load) the configured bound applies as is.
DECODE_SHARE = 0.1
MAX_STRETCH = 4.0
DECAY = 0.97  # weight of a step relative to the next one (an effective window of ~33 steps)
_TOKEN_UNIT = 1e3  # features scaled to similar magnitudes for the 4x4 solve
_PAIR_UNIT = 1e6
# the feature subsets tried: all four, else the best-fitting smaller model; before MIN_STEPS only
# seconds per token (features: 0 the fixed part, 1 tokens, 2 prefill pairs, 3 decode pairs)
FULL_FIT = ((0, 1, 2, 3), (0, 1, 3), (0, 1, 2), (1, 2, 3), (0, 2, 3), (1, 3), (1, 2), (0, 1), (0, 3),
            (1,), (3,), (2,))
PER_TOKEN_FIT = ((1,),)
FEATURES = 4


def attended_pairs(position: int, num_tokens: int) -> int:
    """Query-key pairs of ``num_tokens`` new tokens starting at ``position`` (causal: token i
    attends to ``position + i + 1`` keys)."""
    return num_tokens * position + num_tokens * (num_tokens + 1) // 2


class StepTimeModel:
    def __init__(self, max_step_time: float):
        if max_step_time <= 0:
            raise ValueError(f"max_step_time must be > 0 seconds, got {max_step_time}")
        self.max_step_time = max_step_time
        self._sxx = [[0.0] * FEATURES for _ in range(FEATURES)]
        self._sxy = [0.0] * FEATURES
        self.steps_seen = 0
        self.coef: tuple[float, float, float] | None = None  # (c0 s, a s/token, b s/prefill pair)
        self._rows: tuple[tuple, float] | None = None  # (the coef fitted with it, s/decode pair)

    # ---- learning ----------------------------------------------------------------------------
    def observe(self, tokens: int, pairs: int, seconds: float, decode_pairs: int = 0) -> None:
        """One step that ran: its tokens, its attended pairs (``decode_pairs`` of them by decode rows:
        ``SchedulerOutput.decode_pairs``), its wall time."""
        x = (1.0, tokens / _TOKEN_UNIT, (pairs - decode_pairs) / _PAIR_UNIT, decode_pairs / _PAIR_UNIT)
        sxx, sxy = self._sxx, self._sxy
        for i in range(FEATURES):
            sxy[i] = sxy[i] * DECAY + x[i] * seconds
            row = sxx[i]
            for j in range(FEATURES):
                row[j] = row[j] * DECAY + x[i] * x[j]
        self.steps_seen += 1
        fit = self._fit(FULL_FIT if self.steps_seen >= MIN_STEPS else PER_TOKEN_FIT)
        if fit is None:
            self.coef, self._rows = None, None
            return
        c0, a, prefill, decode = fit  # a kind of pair not seen (or fitted at 0) costs as the other
        self.coef = (c0, a, prefill or decode)
        self._rows = (self.coef, decode or prefill)

    @property
    def row_coef(self) -> tuple[float, float, float] | None:
        """``(c0, a, b)`` with ``b`` the cost of a decode row's pair: what pricing decode rows needs
        (``coef`` where it was set by hand, or before a fit)."""
        if self.coef is None or self._rows is None or self._rows[0] is not self.coef:
            return self.coef
        return self.coef[0], self.coef[1], self._rows[1]

    def _fit(self, subsets: tuple[tuple[int, ...], ...]) -> tuple[float, float, float, float] | None:
        """Non-negative least squares over the features: of ``subsets``, the fit with the smallest
        residual among those whose coefficients are all >= 0 (a small ridge keeps steps that never
        varied a feature solvable)."""
        best, best_err = None, math.inf
        for keep in subsets:
            sol = _solve([[self._sxx[i][j] for j in keep] for i in keep], [self._sxy[i] for i in keep])
            if sol is None or min(sol) < 0:
                continue
            full = [0.0] * FEATURES
            for i, v in zip(keep, sol, strict=True):
                full[i] = v
            err = self._residual(full)
            if err < best_err:
                best, best_err = full, err
        if best is None:
            return None
        return best[0], best[1] / _TOKEN_UNIT, best[2] / _PAIR_UNIT, best[3] / _PAIR_UNIT

    def _residual(self, w: list[float]) -> float:
        # sum of weighted squared errors minus the constant sum of y^2: w'Sxx w - 2 w'Sxy
        quad = sum(w[i] * self._sxx[i][j] * w[j] for i in range(FEATURES) for j in range(FEATURES))
        return quad - 2 * sum(w[i] * self._sxy[i] for i in range(FEATURES))

    # ---- asking ------------------------------------------------------------------------------
    def predict(self, tokens: int, pairs: int, decode_pairs: int = 0) -> float | None:
        """Seconds of a step of ``tokens`` and ``pairs`` attended pairs, ``decode_pairs`` of them by
        decode rows."""
        if self.coef is None:
            return None
        c0, a, b = self.coef
        return c0 + a * tokens + b * (pairs - decode_pairs) + self.row_coef[2] * decode_pairs

    def step_limit(self, decode_spent: float) -> float:
        """The bound of a step whose decodes (and fixed part) are predicted to take
        ``decode_spent`` seconds: ``max_step_time``, stretched so that the decodes are at most
        ``DECODE_SHARE`` of it, up to ``MAX_STRETCH`` times ``max_step_time``."""
        return min(max(self.max_step_time, decode_spent / DECODE_SHARE), MAX_STRETCH * self.max_step_time)

    def prefill_tokens_within(self, spent: float, position: int, wanted: int, floor: bool = True,
                              limit: float | None = None) -> int:
        """How many of ``wanted`` prompt tokens from ``position`` keep the step under ``limit``
        (the step's bound, ``step_limit``; default ``max_step_time``), given ``spent`` seconds
        already predicted for the step (the fixed part included). With ``floor`` (the step's first
        prefill chunk) at least ``chunk_floor`` (or ``wanted`` if smaller) and at least what takes
        ``spent`` again, so that waiting prompts always progress; without it possibly 0."""
        if self.coef is None:
            return wanted
        least = self.chunk_floor(spent, position, wanted, first=floor)
        limit = self.max_step_time if limit is None else limit
        # where the step's other work alone takes the bound or more (many long decodes, a busy
        # machine), prefill may still take as long as that work: the step at most doubles rather
        # than prompts crawling a few tokens per step, each step paying the whole fixed part
        left = max(limit - spent, spent if floor else 0.0)
        if left <= 0:
            return least
        return max(least, min(wanted, int(self._tokens_costing(left, position, wanted))))

    def chunk_floor(self, spent: float, position: int, wanted: int, first: bool = True) -> int:
        """The least of ``wanted`` prompt tokens from ``position`` that a prefill chunk takes, with
        ``spent`` seconds of the step predicted before it (the fixed part included): enough that the
        fixed part is at most ``FIXED_SHARE`` of the step's predicted time (a later chunk tops the
        step up to that), and the step's first chunk at least ``MIN_PREFILL_CHUNK``."""
        least = MIN_PREFILL_CHUNK if first else 0
        short = self.coef[0] / FIXED_SHARE - spent if self.coef and FIXED_SHARE else 0.0
        if short > 0:  # the seconds the chunk must add
            least = max(least, math.ceil(self._tokens_costing(short, position, wanted)))
        return min(wanted, least)

    def _tokens_costing(self, seconds: float, position: int, most: float) -> float:
        """The prompt tokens from ``position`` whose predicted time is ``seconds``: the largest n with
        a*n + b*(n*position + n*(n+1)/2) <= seconds (``most`` where the fit says tokens cost nothing)."""
        _, a, b = self.coef
        lin, quad = a + b * (position + 0.5), b / 2
        if quad > 0:
            return (-lin + math.sqrt(lin * lin + 4 * quad * seconds)) / (2 * quad)
        return seconds / lin if lin > 0 else most


def _solve(m: list[list[float]], y: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small system (with a tiny ridge)."""
    n = len(y)
    a = [row[:] + [y[i]] for i, row in enumerate(m)]
    for i in range(n):
        a[i][i] += 1e-9 * (1.0 + abs(a[i][i]))
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (a[i][n] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens whose KV is computed in this step (the drafts included)
    drafts: list[int] = field(default_factory=list)  # draft tokens verified after the last token

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so its logits give a new token."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.drafts) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    state_copies: list[list[int]] = field(default_factory=list)  # [from row, to row]: kv_cache/state_slots.py
    state_rollbacks: list[list[int]] = field(default_factory=list)  # [slot, rows kept]: the same

    @property
    def attended_pairs(self) -> int:
        """Query-key pairs the step attends (read before ``postprocess`` advances the counts)."""
        return sum(attended_pairs(s.seq.num_computed_tokens, s.num_tokens) for s in self.scheduled)

    @property
    def decode_pairs(self) -> int:
        """Of ``attended_pairs``, those of decode rows (with their drafts), which cost more a pair
        than a prefill chunk's (StepTimeModel)."""
        return sum(attended_pairs(s.seq.num_computed_tokens, s.num_tokens) for s in self.scheduled
                   if s.seq.is_decoding)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @cached_property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences this step gives a new token, in batch order (read once scheduling is done)."""
        return [s.seq for s in self.scheduled if s.samples]
