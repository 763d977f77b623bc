"""A tenant's share of a step's rows (the fair policy): a tenant far over its share cannot make every
step long while another tenant's work waits or runs.

The counters (engine/tenancy/shares.py) share admission and the running set, but once a flood of
long-context streams holds most slots every step decodes all of them, and another tenant's short
request waits for the step in flight and then rides in a step as long: its first token comes a whole
flood step or two later, whatever its counter says. So, while tenants share the engine, the decode
rows of a step are shared too:

- a tenant is **light** while it has fewer sequences in the scheduler (running and waiting) than its
  weighted share of ``max_num_seqs`` among the tenants present; a tenant whose last sequence ended
  less than ``linger`` seconds ago is present, with none (an interactive client sends its next
  request a round trip after the last one ended: that request should not arrive into a long step);
  the others are **heavy**. Every decode row of a light tenant runs;
- nothing is cut where the heavy rows take less than the step's fixed part by the step time model
  (engine/core/step_time.py's ``row_coef``: ``c0 + rows * (a + b * context)``, ``b`` a decode row's
  pair; ``c0`` is the weights read once per step, as on a GPU): fewer rows would cost their tokens and
  save little time. Else:
- while a light tenant's first token is due (a request of it waits for its first step, or it
  lingers), the step is held to ``DUE_STEP_FACTOR`` times the light work's step alone (``c0``, its
  decode rows, and its waiting prompts, or ``LINGER_PROMPT`` tokens while it only
  lingers) by the model: the heavy tenants keep the decode rows that fit in the rest, at most
  ``1 / MAX_ROUNDS`` and at least ``1 / MAX_DUE_ROUNDS`` of them, and their prefill chunks (running
  or admitted) take only what time is left (``prefill_within``; none where nothing is). So the step in
  flight when a light request comes and the step that admits it are each about ``DUE_STEP_FACTOR``
  times its own step alone, and its first token comes within about twice that. After
  ``MAX_DUE_ROUNDS - 1`` due steps in a row, where a heavy tenant has prompt tokens to compute (a
  running prefill, or a waiting sequence with a slot free), the next due step is a **progress step**:
  its heavy decode rows stay as in a due step, and the heavy prefill chunks may take as long as the
  heavy tenants' decode rows would all take (at least the step's fixed part, and at least
  ``PROGRESS_CHUNK`` tokens where the scheduler's step bound allows), so their prompts progress
  while light tenants keep first tokens due (many of them, or one lingering long), yet no step a
  light request can arrive into is longer than a full step of the heavy decode rows (an unheld step
  could stretch to the scheduler's bound, 2 s on a CPU). Without heavy prompt tokens to compute
  every due step is held: the heavy decode rows progress by round robin anyway;
- while light tenants only decode, the heavy tenants' rows are cut to the fewest that keep the
  step's decode tokens per second within ``cost`` of a step with all rows (the fixed part is what
  shorter steps pay again), and never below ``MIN_KEPT`` of them (a bound where the model is off);
- the rows kept are shared between heavy tenants by weight (the smaller counter first), and within
  a tenant go to the sequences that waited longest for a token (round robin): every sequence keeps
  its slot, and gets a token every ``MAX_ROUNDS`` steps at worst outside the due steps (every
  ``MAX_DUE_ROUNDS`` in them);
- with one tenant (or none light, or none heavy, or the policy ``fcfs``, or ``cost`` 0) nothing is
  cut: a lone tenant's steps are unchanged.

Where each row costs much (long contexts on a CPU) steps stay short while a light tenant is
present; where the fixed part of a step dominates nothing changes.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict

from kvserve.engine.sequence import Sequence

MAX_ROUNDS = 4  # a heavy tenant's sequence decodes at least once every MAX_ROUNDS steps
MAX_DUE_ROUNDS = 16  # ... and once every MAX_DUE_ROUNDS steps while a light tenant's first token is due
DUE_STEP_FACTOR = 1.5  # a due step takes at most this times the light work's step alone (by the model)
LINGER_PROMPT = 32  # prompt tokens a due step reserves while a light tenant lingers (its next request's)
MIN_KEPT = 0.5  # of its rows, the least a heavy tenant keeps in a step no light tenant's first token needs
PROGRESS_CHUNK = 32  # prompt tokens a progress step always gives its first heavy chunk (as the scheduler)
MAX_ROW_COST = 0.5  # the largest ``cost`` accepted (half of the heavy tenants' throughput)
MAX_LINGER_S = 60.0


class StepRows:
    """Which decode rows run in the next step (``select``); owned by ``TenantShares``."""

    def __init__(self, shares, cost: float = 0.05, linger: float = 0.25, clock=time.monotonic):
        if not 0 <= cost <= MAX_ROW_COST:
            raise ValueError(f"tenant_row_cost must be in [0, {MAX_ROW_COST}], got {cost}")
        if not 0 <= linger <= MAX_LINGER_S:
            raise ValueError(f"tenant_linger must be in [0, {MAX_LINGER_S}] s, got {linger}")
        self.shares = shares
        self.cost = cost
        self.linger = linger
        self.clock = clock
        self._step = 0
        self._served: dict[int, int] = {}  # seq_id -> the step it last decoded in
        self._left: dict[str, float] = {}  # tenant -> when its last sequence ended (within linger)
        self.held = 0  # decode rows held back in the last step
        self.due_left: float | None = None  # seconds left for heavy prefill chunks in a due step
        self._heavy: set[str] = set()
        self.due_factor = DUE_STEP_FACTOR
        self._due_streak = 0  # due steps in a row
        self.progress = False  # the last step was a progress step (module docstring)
        self._floor = False  # its first heavy prefill chunk keeps PROGRESS_CHUNK tokens
        self.kind = "unshared"  # the last step's, for the step trace (engine/tenancy/step_trace.py)

    def depart(self, tenant: str) -> None:
        """``tenant``'s last sequence ended (``TenantShares.leave``): it lingers from now (only where
        rows are shared: ``_tenants`` forgets them, and ``select`` calls it only then)."""
        if self.shares.fair and self.cost:
            self._left[tenant] = self.clock()

    def _tenants(self) -> dict[str, int]:
        """Tenants present (with work, or within ``linger`` of their last work) -> sequences held."""
        active, now = self.shares.active, self.clock()
        for tenant, left in list(self._left.items()):
            if tenant in active or now - left > self.linger:
                del self._left[tenant]
        present = dict.fromkeys(self._left, 0)
        present.update(active)
        return present

    def lingering(self) -> dict[str, float]:
        """Tenants that linger -> seconds since their last sequence ended."""
        now = self.clock()
        return {tenant: now - left for tenant, left in self._left.items()}

    def select(self, decoding: list[Sequence], running: list[Sequence], clock_model,
               max_num_seqs: int, waiting=()) -> list[Sequence]:
        """The rows of ``decoding`` (running sequences with one token to compute, in admission order)
        that decode in this step (module docstring); the others keep their slot and wait a step."""
        self._step += 1
        self.held, self.due_left, self.progress, self._floor = 0, None, False, False
        self.kind, shares = "unshared", self.shares
        if not shares.fair or self.cost == 0 or shares.plain and not self._left:
            return decoding
        present = self._tenants()
        # decode rows priced at a decode row's pair cost (StepTimeModel.row_coef)
        coef = clock_model.row_coef if clock_model is not None else None
        self.kind = "lone"
        if len(present) < 2 or coef is None:  # (no step has run yet: nothing to weigh the rows by)
            return self._mark(decoding)
        weight = shares.weight
        total = sum(weight(t) for t in present)
        light = {t for t, n in present.items() if n < max_num_seqs * weight(t) / total}
        rows: dict[str, list[Sequence]] = defaultdict(list)
        for seq in decoding:
            rows[seq.tenancy.tenant].append(seq)
        self.kind = "even"
        if not light or len(light) == len(present):
            return self._mark(decoding)
        heavy = [t for t in rows if t not in light]
        heavy_rows = [s for t in heavy for s in rows[t]]
        num_heavy = len(heavy_rows)
        c0, a, b = coef
        # a decode row attends its context
        d = a + b * sum(s.num_tokens for s in heavy_rows) / max(num_heavy, 1)
        keep = num_heavy
        due = self._first_token_due(light, running)
        self._due_streak = self._due_streak + 1 if due else 0
        if self._due_streak >= MAX_DUE_ROUNDS:  # one due step in MAX_DUE_ROUNDS lets heavy prompts
            self._due_streak = 0                 # progress, if any wait (else every due step is held)
            self.progress = self._floor = self._heavy_prompts(light, running, waiting, max_num_seqs)
        if due:
            light_rows = [s for t in rows if t in light for s in rows[t]]
            left = self._due_time(coef, light, light_rows, waiting)
            if num_heavy * d > c0:  # (else the step is mostly its fixed part: fewer rows save little)
                fit = int(max(left, 0.0) / d)
                keep = min(math.ceil(num_heavy / MAX_ROUNDS), max(fit, math.ceil(num_heavy / MAX_DUE_ROUNDS)))
            # a progress step's heavy part may take what all the heavy decode rows would
            heavy_time = max(left, c0 + num_heavy * d) if self.progress else left
            self.due_left = max(heavy_time - keep * d, 0.0)
            self._heavy = {t for t in present if t not in light}
        elif num_heavy * d > c0:
            keep = max(math.ceil(num_heavy * MIN_KEPT), self._rows_kept(len(decoding), num_heavy, c0, d))
        due_kind = "progress" if self.progress else "held"
        self.kind = due_kind if due else "cut" if keep < num_heavy else "whole"
        if keep >= num_heavy:
            return self._mark(decoding)
        kept = {s.seq_id for t in rows if t in light for s in rows[t]}
        for tenant, n in self._split(keep, heavy, rows).items():
            order = sorted(rows[tenant], key=lambda s: self._served.get(s.seq_id, -1))
            kept.update(s.seq_id for s in order[:n])
        chosen = [s for s in decoding if s.seq_id in kept]
        self.held = len(decoding) - len(chosen)
        return self._mark(chosen)

    def _first_token_due(self, light: set[str], running: list[Sequence]) -> bool:
        """Whether a light tenant lingers, or has a request waiting for its first step that its
        running cap (``max_running``) does not hold back."""
        queued, cap = self.shares.queued, self.shares.max_running
        if any(t in self._left for t in light):
            return True
        waiting = [t for t in light if t in queued]
        if not waiting or cap is None:
            return bool(waiting)
        held = Counter(s.tenancy.tenant for s in running)
        return any(held[t] < cap for t in waiting)

    def _heavy_prompts(self, light: set[str], running: list[Sequence], waiting, max_num_seqs: int) -> bool:
        """Whether a heavy tenant has prompt tokens to compute: a running sequence still prefilling,
        or a waiting one where a slot is free for it."""
        if any(s.tenancy.tenant not in light and s.num_tokens - s.num_computed_tokens > 1 for s in running):
            return True
        return len(running) < max_num_seqs and any(w.tenancy.tenant not in light for w in waiting)

    def _due_time(self, coef, light: set[str], light_rows: list[Sequence], waiting) -> float:
        """Seconds of a due step left to the heavy tenants: ``DUE_STEP_FACTOR`` times the light work's
        step alone, less that step."""
        c0, a, b = coef
        alone = c0 + sum(a + b * s.num_tokens for s in light_rows)
        prompts = [w for w in waiting if w.tenancy.tenant in light and w.num_completion_tokens == 0]
        chunks = [(w.num_computed_tokens, w.num_tokens - w.num_computed_tokens) for w in prompts]
        for position, n in chunks or [(0, LINGER_PROMPT)]:
            alone += a * n + b * (n * position + n * (n + 1) / 2)
        return (self.due_factor - 1.0) * alone

    def prefill_within(self, seq: Sequence, position: int, n: int, clock_model) -> int:
        """Of ``n`` prompt tokens of ``seq`` from ``position``, those that fit a due step's time left
        to a heavy tenant (all of them outside due steps, or for a light tenant's sequence)."""
        if self.due_left is None or seq.tenancy.tenant not in self._heavy:
            return n
        _, a, b = clock_model.coef
        lin, quad = a + b * (position + 0.5), b / 2  # a*n + b*(n*position + n*(n+1)/2) <= due_left
        fit = (-lin + math.sqrt(lin * lin + 4 * quad * self.due_left)) / (2 * quad) if quad > 0 else (
            self.due_left / lin if lin > 0 else n)
        n = min(n, max(int(fit), PROGRESS_CHUNK if self._floor else 0))
        self._floor = False
        self.due_left = max(self.due_left - (a * n + b * (n * position + n * (n + 1) / 2)), 0.0)
        return n

    def _rows_kept(self, num_rows: int, num_heavy: int, c0: float, d: float) -> int:  # (d > 0)
        """How many heavy rows run: the fewest rows ``n`` of the step whose decode tokens per second
        ``n / (c0 + n d)`` stay within ``cost`` of all ``num_rows`` rows', less the light rows."""
        eps = self.cost
        # n / (c0 + n d) >= (1 - eps) R / (c0 + R d)  <=>  n >= (1 - eps) R c0 / (c0 + eps R d)
        denominator = c0 + eps * num_rows * d
        need = num_rows if denominator <= 0 else math.ceil((1 - eps) * num_rows * c0 / denominator - 1e-9)
        return max(need - (num_rows - num_heavy), 1)

    def _split(self, keep: int, heavy: list[str], rows: dict[str, list[Sequence]]) -> dict[str, int]:
        """``keep`` rows between the heavy tenants: one at a time to the tenant with the fewest per
        unit of weight (the smaller counter first among equals), none beyond a tenant's rows."""
        weight, counters = self.shares.weight, self.shares.counters
        taken = dict.fromkeys(heavy, 0)
        for _ in range(keep):
            open_ = [t for t in heavy if taken[t] < len(rows[t])]
            if not open_:
                break
            t = min(open_, key=lambda t: (taken[t] / weight(t), counters.get(t, 0.0)))
            taken[t] += 1
        return taken

    def _mark(self, chosen: list[Sequence]) -> list[Sequence]:
        served, step = self._served, self._step
        for seq in chosen:
            served[seq.seq_id] = step
        if len(served) > 4 * len(chosen) + 256:  # forget sequences not seen for a while
            for seq_id in [i for i, s in served.items() if step - s > 4 * MAX_ROUNDS]:
                del served[seq_id]
        return chosen
