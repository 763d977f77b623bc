"""Sharing the engine between tenants: which waiting sequence goes next, which running one gives
way, and a tenant's caps (the scheduler asks; plain Python, no torch; deadlines: deadlines.py).

Under the ``fair`` policy every tenant with work in the scheduler (waiting or running) has a
virtual token counter: the tokens computed for it (prefill chunks and decode tokens, counted when
a step schedules them) divided by its weight. Waiting work is taken from the tenant with the
smallest counter among those with work waiting, and within a tenant by ``priority`` (lower
first), then the earlier deadline, then queue order (a preempted sequence is at the head). This is
the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI '24),
which llm-d-router #1182 and the Gateway API inference extension's #1797 ask for at the router and
vLLM's closed PR 31909 tried (per request, by weight) in the scheduler; here it runs per tenant
inside the scheduler, so the running set is shared too:

- a tenant that comes back after idling starts at the smallest counter of the tenants with work,
  neither credit banked while idle nor debt kept (its counter is forgotten when its work ends);
- while a tenant under its share of the slots has work (or had, a moment ago), the decode rows of
  the tenants over theirs are cut so that steps stay short (engine/tenancy/rows.py);
- a waiting sequence may preempt a running one of another tenant whose counter is larger and who
  holds more running sequences per unit of weight than the waiter would after admission (the
  second condition stops two tenants from trading one slot back and forth every step), or one of
  its own tenant with a lower priority.

``fcfs`` keeps the order work arrived in (preempted work first) and neither counts nor preempts
for anyone: the scheduler as it was before tenants. Both policies apply the per-tenant caps.
"""

from __future__ import annotations

import math
from collections import Counter

from kvserve.engine.sequence import Sequence
from kvserve.engine.tenancy.rows import StepRows

POLICIES = ("fair", "fcfs")


class TenantLimit(Exception):
    """A tenant's cap is reached (RESOURCE_EXHAUSTED); the message names the limit."""


class DeadlineUnreachable(Exception):
    """The request cannot start before its deadline (DEADLINE_EXCEEDED)."""


class TenantShares:
    """The counters, caps and order of one scheduler (weights checked by ``EngineConfig``)."""

    def __init__(self, policy: str = "fair", weights: dict[str, float] | None = None,
                 max_running: int | None = None, max_queued: int | None = None,
                 row_cost: float = 0.05, linger: float = 0.25):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.fair = policy == "fair"
        self.weights = dict(weights or {})
        self.max_running = max_running
        self.max_queued = max_queued
        self.counters: dict[str, float] = {}  # tenants with work in the scheduler only
        self.active: Counter[str] = Counter()  # sequences in the scheduler, per tenant
        self.queued: dict[str, set[int]] = {}  # requests never scheduled yet, per tenant (seq ids)
        # nothing but one tenant's plain work seen so far: the queue's head is always next (the
        # common single-tenant case costs no scan)
        self.plain = not (self.fair and self.weights) and max_running is None
        self._tenant: str | None = None
        self.rows = StepRows(self, row_cost, linger)  # the step's decode rows (engine/tenancy/rows.py)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    # ---- work entering and leaving ----------------------------------------------------------
    def join(self, seq: Sequence) -> None:
        """``seq`` entered the scheduler (a new request, or a choice forked from one)."""
        t = seq.tenancy
        if self.plain and (t.priority or t.deadline is not None or self._tenant not in (None, t.tenant)):
            self.plain = False
        self._tenant = t.tenant
        if not self.active[t.tenant]:
            self.counters[t.tenant] = min(self.counters.values(), default=0.0)
        self.active[t.tenant] += 1

    def leave(self, seq: Sequence) -> None:
        """``seq`` finished (or was aborted) while in the scheduler."""
        tenant = seq.tenancy.tenant
        self.started(seq)
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            self.counters.pop(tenant, None)
            self.rows.depart(tenant)

    def enqueue(self, seq: Sequence) -> None:
        self.queued.setdefault(seq.tenancy.tenant, set()).add(seq.seq_id)

    def started(self, seq: Sequence) -> None:
        """``seq`` was scheduled for the first time (or ended): no longer a queued request."""
        ids = self.queued.get(seq.tenancy.tenant)
        if ids is not None:
            ids.discard(seq.seq_id)
            if not ids:
                del self.queued[seq.tenancy.tenant]

    def charge(self, seq: Sequence, tokens: int) -> None:
        """``tokens`` computed for ``seq`` in the step being scheduled."""
        if self.fair:
            tenant = seq.tenancy.tenant
            self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens / self.weight(tenant)

    # ---- admission --------------------------------------------------------------------------
    def check_queue(self, seq: Sequence) -> None:
        """Refuse a request of a tenant that has ``max_queued`` requests waiting already."""
        waiting = len(self.queued.get(seq.tenancy.tenant, ()))
        if self.max_queued is not None and waiting >= self.max_queued:
            raise TenantLimit(f"this tenant has {waiting} requests waiting to run "
                              f"(--max-queued-per-tenant {self.max_queued}); retry later")

    # ---- order ------------------------------------------------------------------------------
    def pick(self, waiting, running_by_tenant: Counter[str] | None) -> Sequence | None:
        """The waiting sequence to admit next (None: every waiting tenant is at its running cap)."""
        if self.plain:
            return waiting[0]
        best, best_key = None, None
        counters, cap = self.counters, self.max_running
        for i, seq in enumerate(waiting):
            t = seq.tenancy
            if cap is not None and running_by_tenant[t.tenant] >= cap:
                continue
            if not self.fair:
                return seq
            deadline = math.inf if t.deadline is None else t.deadline
            key = (counters.get(t.tenant, 0.0), t.priority, deadline, i)
            if best_key is None or key < best_key:
                best, best_key = seq, key
        return best

    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt when blocks run out: of the tenant with the largest
        counter (then the most slots per weight), the lowest priority, the most recently admitted
        (the tail, under ``fcfs``)."""
        if self.plain or not self.fair:
            return running[-1]
        counters, held = self.counters, Counter(s.tenancy.tenant for s in running)
        # among equal counters the tenant holding more slots per unit of weight gives way first
        return max(reversed(running), key=lambda s: (counters.get(s.tenancy.tenant, 0.0),
                                                     held[s.tenancy.tenant] / self.weight(s.tenancy.tenant),
                                                     s.tenancy.priority))

    def yielding(self, waiter: Sequence, running: list[Sequence],
                 running_by_tenant: Counter[str]) -> Sequence | None:
        """A running sequence that should give way to ``waiter`` (module docstring), or None."""
        if self.plain or not self.fair:
            return None
        t, counters = waiter.tenancy, self.counters
        share = (running_by_tenant[t.tenant] + 1) / self.weight(t.tenant)
        best, best_key = None, None
        for seq in reversed(running):  # the most recently admitted first among equals
            r = seq.tenancy
            if not self.outranks(waiter, seq):
                continue
            if r.tenant == t.tenant:
                key = (1, r.priority)  # another tenant's overdue share goes before our own priority
            elif running_by_tenant[r.tenant] / self.weight(r.tenant) > share:
                key = (2, counters.get(r.tenant, 0.0))
            else:
                continue
            if best_key is None or key > best_key:
                best, best_key = seq, key
        return best

    def outranks(self, waiter: Sequence, seq: Sequence) -> bool:
        """Whether ``waiter`` comes before running ``seq``: a lower priority of its own tenant, or
        another tenant's with a larger counter (fair policy only)."""
        t, r = waiter.tenancy, seq.tenancy
        if not self.fair:
            return False
        if r.tenant == t.tenant:
            return r.priority > t.priority
        return self.counters.get(r.tenant, 0.0) > self.counters.get(t.tenant, 0.0)

