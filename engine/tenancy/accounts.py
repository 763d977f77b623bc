"""What each tenant got from the engine, for /metrics: its running and waiting sequences, its prompt
and generated tokens, its requests refused by reason (engine/core/llm_engine.py counts them; the
front-end exports them: service/telemetry/metrics.py).

A tenant's label is a short form of the identity the server already hashed ("header:" or "api-key:"
and the first 16 hex digits of the sha256 of the header value or credential; "default" on a server
without tenants), never the credential itself: /metrics is served without authentication. At most
``MAX_TENANT_LABELS`` tenants get a label of their own, first come first labelled, kept for the
process's life (a counter's series must not move); the others are counted together under ``other``,
so a server with many callers exports a bounded number of series.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from kvserve.engine.sequence import Sequence
from kvserve.engine.tenancy.shares import DeadlineUnreachable, TenantLimit

MAX_TENANT_LABELS = 32
OTHER = "other"
REFUSALS = {TenantLimit: "max_queued_per_tenant", DeadlineUnreachable: "deadline"}


class TenantStats(msgspec.Struct, array_like=True):
    """One label's series (EngineStats.tenants)."""

    tenant: str
    running: int  # sequences (choices) running now
    waiting: int  # sequences in the scheduler's waiting queue now
    prompt_tokens: int  # since start: prompt tokens of its requests
    generation_tokens: int  # since start: tokens generated for it
    refused: dict[str, int]  # since start, by reason (REFUSALS' values)


def tenant_label(tenant: str) -> str:
    """The label of a tenant identity ("source:sha256hex", or "" for the one tenant)."""
    if not tenant:
        return "default"
    source, _, digest = tenant.partition(":")
    return f"{source}:{digest[:16]}"


class TenantAccounts:
    """Counters per label, at most ``max_labels`` labels besides ``other``."""

    def __init__(self, max_labels: int = MAX_TENANT_LABELS):
        self.max_labels = max_labels
        self._labels: dict[str, str] = {}  # tenant identity -> its label
        self._stats: dict[str, TenantStats] = {}  # by label

    def label(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:
            if len(self._labels) >= self.max_labels:
                return OTHER
            label = self._labels[tenant] = tenant_label(tenant)
        return label

    def _account(self, tenant: str) -> TenantStats:
        label = self.label(tenant)
        if label not in self._stats:
            self._stats[label] = TenantStats(label, 0, 0, 0, 0, {})
        return self._stats[label]

    def prompt(self, tenant: str, tokens: int) -> None:
        self._account(tenant).prompt_tokens += tokens

    def generated(self, tenant: str, tokens: int) -> None:
        self._account(tenant).generation_tokens += tokens

    def refused(self, tenant: str, error: BaseException) -> None:
        """Count ``error`` when it is a tenant's refusal (REFUSALS); other errors are not."""
        reason = REFUSALS.get(type(error))
        if reason is not None:
            refused = self._account(tenant).refused
            refused[reason] = refused.get(reason, 0) + 1

    def snapshot(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> list[TenantStats]:
        """Every label's series, the gauges read from the scheduler's queues now."""
        now_running = Counter(self.label(s.tenancy.tenant) for s in running)
        now_waiting = Counter(self.label(s.tenancy.tenant) for s in waiting)
        for label in (now_running | now_waiting).keys() - self._stats.keys():
            self._stats[label] = TenantStats(label, 0, 0, 0, 0, {})
        return [TenantStats(label, now_running[label], now_waiting[label], s.prompt_tokens,
                            s.generation_tokens, dict(s.refused)) for label, s in self._stats.items()]
