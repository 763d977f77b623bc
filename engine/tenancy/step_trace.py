"""A record of every step the engine runs, opt-in (``--step-trace PATH``): which steps a request's first
token waited on, and why each was as long as it was (docs/serving/tenants.md, "The step trace").

JSON lines appended to ``PATH``, on the engine core's ``time.monotonic()`` clock (the same clock as the
service's and a client's on that machine):

- one per step (``"step"``): its index, ``start`` and ``end``; ``gap``, the seconds since the last
  step ended (the engine core's loop between steps: taking inputs, sending outputs); ``actual`` and
  ``predicted`` seconds (the step time model's fit ``coef`` = ``(c0, a, b)`` when the step was
  scheduled), its ``tokens`` and attended ``pairs``; its ``kind`` in engine/tenancy/rows.py's terms
  (``StepRows.kind``: ``lone`` one tenant present, ``held`` a light tenant's first token due,
  ``progress``, ``cut`` light tenants only decode, ``whole`` nothing to cut, ``even`` no tenant light
  or none heavy, ``unshared`` rows not shared); the tenants that ``linger`` (seconds since their last
  sequence ended); per tenant the decode ``rows`` run, the decode rows ``held`` back, the ``prefill``
  tokens computed and the sequences ``waiting``; the sequences ``preempted``; ``gc``, the seconds the
  garbage collector ran since the last record;
- one per sequence's first token (``"first"``: the request's key, the front-end's ``request_id#n``;
  ``tenant``; ``arrived``, when the engine core took it, and ``after``, the step that had ended last
  then; ``admitted``, the step that first scheduled it; ``step``, the one that gave its first token).

Off (the default) the engine pays one ``is None`` test per step. Plain Python, no torch.
"""

from __future__ import annotations

import gc
import json
import time
from bisect import bisect_right

KEPT_STEPS = 100_000  # step start times kept for a request's lookups (trimmed to half when reached)


class StepTrace:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - a line per step until close()
        self._index = 0  # the next step's
        self._starts: list[float] = []  # of the last steps, for ``_step_at``
        self._first = 0  # the index of _starts[0]
        self._last_end: float | None = None
        self._plan: dict = {}
        self._gc, self._gc_started = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc += time.perf_counter() - self._gc_started
            self._gc_started = None

    def planned(self, out, scheduler, pairs: int, decode_pairs: int) -> None:
        """What the scheduler chose for the step about to run (before the model runs)."""
        rows, clock = scheduler.shares.rows, scheduler.step_clock
        tenants: dict[str, dict[str, int]] = {}

        def of(seq) -> dict[str, int]:
            return tenants.setdefault(seq.tenancy.tenant, {"rows": 0, "held": 0, "prefill": 0, "waiting": 0})

        scheduled = set()
        for s in out.scheduled:
            scheduled.add(s.seq.seq_id)
            decode = s.seq.is_decoding
            of(s.seq)["rows" if decode else "prefill"] += 1 if decode else s.num_tokens
        for seq in scheduler.running:
            if seq.seq_id not in scheduled and seq.is_decoding:
                of(seq)["held"] += 1
        for seq in scheduler.waiting:
            of(seq)["waiting"] += 1
        coef = clock.coef if clock is not None else None
        predicted = clock.predict(out.num_tokens, pairs, decode_pairs) if coef else None
        self._plan = {"kind": rows.kind, "linger": rows.lingering(), "coef": coef,
                      "decode_pair": clock.row_coef[2] if coef else None, "tokens": out.num_tokens,
                      "pairs": pairs, "decode_pairs": decode_pairs, "predicted": predicted,
                      "tenants": tenants, "preempted": len(out.preempted)}

    def ran(self, out, seconds: float) -> None:
        """The step planned last ran in ``seconds`` (as the step time model observed it)."""
        end = time.monotonic()
        start, index = end - seconds, self._index
        self._index += 1
        self._starts.append(start)
        if len(self._starts) >= KEPT_STEPS:
            del self._starts[:KEPT_STEPS // 2]
            self._first += KEPT_STEPS // 2
        gap = None if self._last_end is None else start - self._last_end
        self._last_end = end
        record = {"step": index, "start": start, "end": end, "gap": gap, "actual": seconds, **self._plan,
                  "gc": self._gc}
        self._gc = 0.0
        self._write(record)
        for seq in out.sampling_seqs:
            times = seq.times
            if times.first_token is not None and times.first_token >= start:
                self._write({"first": seq.request_id, "seq": seq.seq_id, "tenant": seq.tenancy.tenant,
                             "arrived": times.arrival, "after": self._step_at(times.arrival),
                             "admitted": self._step_at(times.first_scheduled), "step": index})

    def _step_at(self, t: float | None) -> int | None:
        """The last step that started at or before ``t`` (None: before the steps kept)."""
        k = bisect_right(self._starts, t) - 1 if t is not None else -1
        return None if k < 0 else self._first + k

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._file.close()
