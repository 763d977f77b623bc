"""Deadline-aware admission (the fair policy): a request is refused at once with DEADLINE_EXCEEDED when,
by the step time model (engine/core/step_time.py: ``c0 + a * tokens + b * pairs`` a step), it cannot
*start* before its deadline, cannot *finish* before it, or would make a request already admitted miss
its own. The scheduler asks (``AdmissionChecks.check_admission``); plain Python, no torch.

- **start** (``start_delay``): a lower bound of the wait, the prompts ordered before it prefilled at
  the step's token budget and, when they and it outnumber the free slots, the decode steps until enough
  running sequences end.
- **finish** (``finish_time``): the start, its prompt's prefill, then its ``max_tokens`` decode steps
  at the step time of the batch it joins: the running and waiting sequences and its ``n`` choices, at
  most ``max_num_seqs`` rows, each row's context half-way through what it still has to generate. Under
  overload every admitted request shares every step: without this check the server admits work that
  starts in time, and once the batch is large enough its steps are too slow for any of it to finish.
- **the others' promise** (``hurts``): a request is refused when the rows it adds would slow the steps
  enough that a running or waiting request with a deadline, which would finish in time without it,
  no longer would. So the running set stays at what finishes in time and the rest is refused at once
  (a client can retry elsewhere) rather than every request finishing late.

All three use the model's fit as it stands (it follows the machine's speed); before the model has
seen a step only deadlines already past are refused.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from kvserve.engine.sequence import Sequence
from kvserve.engine.tenancy.shares import DeadlineUnreachable

Coef = tuple[float, float, float]  # the step time model's (c0, a, b)
clock = time.monotonic  # the deadlines' clock (Tenancy.deadline; a simulation sets its own)


def start_delay(waiting, running: list[Sequence], seq: Sequence, max_num_seqs: int, budget: int,
                coef: Coef, remaining, could_yield) -> float:
    """A lower bound of the seconds before ``seq`` (of a tenant, not yet queued) can start, by the step
    time model's ``coef`` (engine/core/step_time.py): the prompts ordered before it prefilled at
    ``budget`` tokens a step, and, when they and it outnumber the free slots, the decode steps until
    enough running sequences reach their ``remaining(seq)`` tokens (those that ``could_yield`` to it
    free their slot at once)."""
    c0, a, b = coef
    tenant, order = seq.tenancy.tenant, _order(seq)
    ahead = [w for w in waiting if w.tenancy.tenant == tenant and _order(w) <= order]
    own = len(ahead)
    taken: Counter[str] = Counter()  # another tenant's work interleaves: as many as ours, and one
    for w in waiting:
        other = w.tenancy.tenant
        if other != tenant and taken[other] <= own:
            taken[other] += 1
            ahead.append(w)
    tokens = sum(w.num_tokens - w.num_computed_tokens for w in ahead)
    delay = a * tokens + c0 * math.ceil(tokens / budget)
    staying = [r for r in running if not could_yield(r)]
    short = len(ahead) + 1 - (max_num_seqs - len(staying))
    if short > 0 and staying:
        steps = sorted(remaining(r) for r in staying)[min(short, len(staying)) - 1]
        positions = sum(r.num_tokens for r in running)
        delay += steps * (c0 + a * len(running) + b * positions)
    return delay


def decode_step(batch: list[Sequence], max_num_seqs: int, coef: Coef, remaining) -> float:
    """Predicted seconds of a decode step of ``batch`` (its first ``max_num_seqs`` rows run at once),
    each row attending its context half-way through its ``remaining`` tokens."""
    c0, a, b = coef
    if not batch:
        return c0
    rows = min(len(batch), max_num_seqs)
    context = sum(s.num_tokens + remaining(s) / 2 for s in batch) / len(batch)
    return c0 + rows * (a + b * context)


def finish_time(seq: Sequence, start: float, step: float, coef: Coef, remaining) -> float:
    """Predicted seconds from now until ``seq`` (not yet queued) finishes: ``start``, its prompt's
    prefill (one step), then its other tokens at ``step`` seconds each."""
    c0, a, b = coef
    prompt = seq.num_tokens - seq.num_computed_tokens
    prefill = c0 + a * prompt + b * (prompt * seq.num_computed_tokens + prompt * (prompt + 1) / 2)
    return start + prefill + max(remaining(seq) - 1, 0) * step


def hurts(seq: Sequence, others: list[Sequence], max_rows: int, step_without: float, step_with: float,
          remaining, now: float) -> Sequence | None:
    """A sequence of ``others`` with a deadline that would finish in time at ``step_without`` seconds a
    step and would not at ``step_with`` (``seq`` admitted), or None; none where ``others`` fill the
    ``max_rows`` rows of a step already (``seq`` adds no row: it waits for a slot)."""
    if step_with <= step_without or len(others) >= max_rows:  # (past max_rows it waits for a slot)
        return None
    for other in others:
        deadline = other.tenancy.deadline
        if deadline is None or other is seq:
            continue
        left = deadline - now
        if remaining(other) * step_without <= left < remaining(other) * step_with:
            return other
    return None


def check_finish(seq: Sequence, start: float, waiting, running: list[Sequence], max_num_seqs: int,
                 coef: Coef, remaining) -> None:
    """Refuse ``seq`` (``DeadlineUnreachable``) when it cannot finish before its deadline, or when it
    would make another request miss its own (module docstring)."""
    deadline = seq.tenancy.deadline
    now = clock()
    others = list(running) + list(waiting)
    step_without = decode_step(others, max_num_seqs, coef, remaining)
    step_with = decode_step(others + [seq] * seq.params.n, max_num_seqs, coef, remaining)  # its n choices
    if deadline is not None:
        left = deadline - now
        finish = finish_time(seq, start, step_with, coef, remaining)
        if finish > left:
            rows = min(len(others) + seq.params.n, max_num_seqs)
            raise DeadlineUnreachable(
                f"the request cannot finish before its deadline: {max(left, 0.0) * 1000:.0f} ms left, about "
                f"{finish * 1000:.0f} ms to start and generate its {remaining(seq)} tokens at {rows} rows a "
                f"step (step time model)")
    victim = hurts(seq, others, max_num_seqs, step_without, step_with, remaining, now)
    if victim is not None:
        raise DeadlineUnreachable(
            f"the request cannot be admitted without making an admitted request miss its deadline: its row "
            f"would slow every step from {step_without * 1000:.1f} to {step_with * 1000:.1f} ms "
            f"(step time model)")


def _order(seq: Sequence) -> tuple[int, float]:
    t = seq.tenancy
    return t.priority, math.inf if t.deadline is None else t.deadline


def check_deadline(seq: Sequence, delay: float) -> None:
    """Refuse ``seq`` when ``delay`` seconds from now pass its deadline."""
    deadline = seq.tenancy.deadline
    if deadline is None:
        return
    left = deadline - clock()
    if left <= 0 or delay > left:
        raise DeadlineUnreachable(
            f"the request cannot start before its deadline: {max(left, 0.0) * 1000:.0f} ms left, about "
            f"{delay * 1000:.0f} ms of work is ahead of it (step time model)")
