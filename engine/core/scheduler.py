"""Continuous batching: which sequences run in the next step, and how many tokens each.

Plain Python (no torch). One step mixes decode tokens of running sequences with prefill
chunks (of running sequences still prefilling, then of newly admitted waiting ones) under
one token budget, ``max_num_batched_tokens``. Decode-phase sequences are served first so that
streams keep producing tokens while a long prompt is prefilled in chunks.

When KV blocks run out, the most recently admitted running sequence is preempted: its
blocks are freed and it returns to the head of the waiting queue, to be recomputed later
(prefix-cache hits make that cheap). Greedy outputs do not change.

Forward progress: the other choices of a request (``n`` > 1) wait holding references on its
prompt's blocks (``fork``). Those pins are released before a sequence would preempt itself,
and when nothing runs and the head of the queue cannot be admitted; so the oldest running
sequence always gets its blocks (``check_fits`` made sure the whole cache holds it) and an
empty engine always admits its head: every request finishes.

Between tenants (engine/tenancy/shares.py): which waiting sequence is next, which running one is
preempted, which running one gives way to waiting work, by tokens served per tenant, priority
and deadline, and which decode rows a step takes (engine/tenancy/rows.py); a request that cannot
start or finish before its deadline is refused at once (engine/tenancy/deadlines.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque

from kvserve.engine.core.block_manager import BlockManager
from kvserve.engine.core.step_time import ScheduledSeq, SchedulerOutput, StepTimeModel, attended_pairs
from kvserve.engine.kv_cache.state_slots import turn_checkpoints
from kvserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvserve.engine.tenancy.admission import AdmissionChecks
from kvserve.engine.tenancy.shares import TenantShares


class Scheduler(AdmissionChecks):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        max_step_time: float | None = None,
        last_prompt_token_alone: bool = False,
        shares: TenantShares | None = None,
    ):
        self.bm = block_manager
        self.shares = shares or TenantShares()
        # seconds a step may take (prefill chunks shrink to fit; engine/core/step_time.py); None: no bound
        self.step_time = StepTimeModel(max_step_time) if max_step_time else None
        # learns step times for deadline-aware admission (fair policy) even where steps have no bound
        self.step_clock = self.step_time or (StepTimeModel(math.inf) if self.shares.fair else None)
        self._spent = 0.0  # predicted seconds of the step being scheduled
        self._out_of_time = False  # the last admission failed for the step's time bound
        self._limit = 0.0  # its time bound, set at its first prefill chunk (StepTimeModel.step_limit)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # the most tokens a sequence may reach: max_model_len, and no more than the whole KV cache
        # holds of it at once (``BlockManager.peak_blocks``: window groups hold only their window)
        self.max_seq_len = self._longest_fitting(max_model_len)
        self.eos_token_ids = frozenset(eos_token_ids)
        # compute a seeded request's last prompt token in a step of its own, as a decode row, so
        # that its first token's logits do not depend on how much of the prompt the prefix cache
        # held (llm.proto's seed promise). Only seeded requests: it costs one step of first-token
        # latency, which the others (no reproducibility asked) do not pay
        self.last_prompt_token_alone = last_prompt_token_alone
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is the preemption victim
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        if self.bm.state_slots is not None:  # (kv_cache/state_slots.py)
            seq.checkpoint_at = (seq.num_prompt_tokens - 1) // self.bm.block_size * self.bm.block_size or None
            if self.bm.enable_prefix_caching and seq.checkpoint_at:
                seq.turn_checkpoints = turn_checkpoints(seq.token_ids, self.eos_token_ids, self.bm.block_size,
                                                        seq.checkpoint_at)
        self.waiting.append(seq)
        self.shares.join(seq)
        self.shares.enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        coef = self.step_time.coef if self.step_time else None
        self._spent = coef[0] if coef else 0.0
        self._prefilled = False
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            if not self._prefills_this_step(out):
                budget = self._schedule_drafts(out, budget)
            self._schedule_waiting(out, budget)
        if out.scheduled and self.bm.state_slots is not None:  # copied before the step's model runs
            out.state_copies = self.bm.state_slots.take_copies()
            out.state_rollbacks = self.bm.state_slots.take_rollbacks()  # (before the copies)
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.times.first_scheduled is None:
                s.seq.times.first_scheduled = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # decode-phase sequences first, then those still prefilling, each in admission order
        decoding, prefilling = [], []
        for seq in self.running:
            (decoding if seq.is_decoding else prefilling).append(seq)
        decoding = self.shares.rows.select(decoding, self.running, self.step_clock, self.max_num_seqs,
                                           self.waiting)
        scheduled: dict[int, ScheduledSeq] = {}
        running, bm = SequenceStatus.RUNNING, self.bm
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not running:  # preempted earlier in this loop
                continue
            done = seq.num_computed_tokens
            n = self._chunk(seq, done, len(seq.token_ids) - done, budget)
            if n == 0:  # a prefill chunk that no longer fits the step's time
                continue
            missing = bm.missing_blocks(seq, n)
            while missing > bm.num_free_blocks:
                victim = self.shares.victim(self.running)
                if victim is seq and self._release_pinned():
                    continue  # the pins were the last blocks to take before giving up seq's own
                budget += self._preempt(victim, scheduled, out)
                if victim is seq:
                    break
            if seq.status is not running:
                continue
            bm.take_blocks(seq, missing)
            scheduled[seq.seq_id] = ScheduledSeq(seq, n)
            budget -= n
        for s in scheduled.values():
            self.shares.charge(s.seq, s.num_tokens)
        out.scheduled.extend(scheduled.values())
        return budget

    def _chunk(self, seq: Sequence, position: int, remaining: int, budget: int) -> int:
        """Tokens of ``seq`` to compute now, from ``position``: as many as the budget allows; with
        ``last_prompt_token_alone`` a seeded request's prefill chunk stops before the prompt's last
        token (see __init__); then cut to what keeps the step under ``max_step_time`` (a decode
        token is never cut; the first prefill chunk of a step keeps a minimum, so prompts always
        progress; later ones may get 0). Adds the chunk's predicted time to the step's."""
        if seq.checkpoint_at is not None and position < seq.checkpoint_at:  # its state is kept there
            stop = next((at for at in seq.turn_checkpoints if at > position), seq.checkpoint_at)
            remaining = min(remaining, stop - position)
        if (self.last_prompt_token_alone and remaining > 1 and seq.num_completion_tokens == 0
                and seq.params.seed is not None):
            remaining -= 1
        n = min(remaining, budget)
        if n > 1:  # a heavy tenant's chunk in a step where a light tenant's first token is due
            n = self.shares.rows.prefill_within(seq, position, n, self.step_clock)
        model = self.step_time
        if model is None or model.coef is None:
            return n
        if n > 1:
            if not self._prefilled:  # the step's first chunk: its bound follows the decodes before it
                self._limit = model.step_limit(self._spent)
            n = model.prefill_tokens_within(self._spent, position, n, floor=not self._prefilled,
                                            limit=self._limit)
            self._prefilled = self._prefilled or n > 0
        _, a, b = model.coef
        self._spent += a * n + b * attended_pairs(position, n)
        return n

    def _prefills_this_step(self, out: SchedulerOutput) -> bool:
        """Whether the step computes a prefill chunk (a running sequence's, or an admission's): drafts
        then stay out, since the step's rows run through GEMMs whose rounding depends on how many
        there are, and plain decoding's tokens would not be kept bit for bit."""
        # with tenants (or priorities, deadlines) a waiting sequence may be admitted into a full
        # running set, in place of one that gives way to it
        admitting = self.waiting and (len(self.running) < self.max_num_seqs or not self.shares.plain)
        return bool(admitting) or any(s.num_tokens > 1 for s in out.scheduled)

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Verify the draft tokens of decode sequences (``Sequence.draft_token_ids``) as extra query
        tokens, as far as the budget, max_model_len, max_tokens and free blocks allow: drafts never
        preempt anything. Returns the budget left."""
        for s in out.scheduled:
            seq = s.seq
            if not seq.draft_token_ids or s.num_tokens != 1 or not s.samples or budget <= 0:
                continue
            # every draft kept plus the bonus token must fit max_tokens and max_model_len
            room = min(self.max_new_tokens(seq) - seq.num_completion_tokens,
                       self.max_seq_len - seq.num_tokens) - 1
            k = max(0, min(len(seq.draft_token_ids), budget, room))
            while k and self.bm.missing_blocks(seq, 1 + k) > self.bm.num_free_blocks:
                k -= 1
            if k:
                self.bm.take_blocks(seq, self.bm.missing_blocks(seq, 1 + k))
                s.drafts = seq.draft_token_ids[:k]
                s.num_tokens += k
                budget -= k
        return budget

    def _preempt(self, seq: Sequence, scheduled: dict[int, ScheduledSeq], out: SchedulerOutput) -> int:
        """Send ``seq`` back to the head of the waiting queue; return the budget it gave back."""
        self.running.remove(seq)
        given_back = scheduled.pop(seq.seq_id).num_tokens if seq.seq_id in scheduled else 0
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        return given_back

    def _release_pinned(self, keep: Sequence | None = None) -> bool:
        """Free the blocks that waiting forked choices (other than ``keep``) hold: they will compute
        their prompt again, as a preempted sequence does. Returns whether any held blocks."""
        pinned = [seq for seq in self.waiting if seq.block_table and seq is not keep]
        for seq in pinned:
            self.bm.free(seq)
            seq.num_preemptions += 1
            self.num_preemptions += 1
        return bool(pinned)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in the tenants' order (``TenantShares.pick``) while slots, blocks
        and budget last; a running sequence that should give way to the next one
        (``TenantShares.yielding``) is preempted for it when slots or blocks are short."""
        shares = self.shares
        by_tenant = None if shares.plain else Counter(s.tenancy.tenant for s in self.running)
        evicted = 0
        while self.waiting and budget > 0:
            seq = shares.pick(self.waiting, by_tenant)
            if seq is None:
                break
            n, self._out_of_time = None, False
            if len(self.running) < self.max_num_seqs:
                n = self._admit_head(seq, budget)
                if n is None and not self.running and self._release_pinned(keep=seq):
                    n = self._admit_head(seq, budget)  # nothing runs: only the pins stood in the way
            if n is None:
                # a slot or blocks are short, not the step's time (no preemption gives that back);
                # at most max_num_seqs preemptions a step: a guard against a cycle of them
                if by_tenant is None or self._out_of_time or evicted >= self.max_num_seqs:
                    break
                victim = shares.yielding(seq, self.running, by_tenant)
                if victim is None:
                    break
                evicted += 1
                by_tenant[victim.tenancy.tenant] -= 1
                budget += self._evict(victim, out)
                continue
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            shares.started(seq)
            shares.charge(seq, n)
            if by_tenant is not None:
                by_tenant[seq.tenancy.tenant] += 1
            budget -= n

    def _evict(self, victim: Sequence, out: SchedulerOutput) -> int:
        """Preempt ``victim`` (perhaps scheduled already in this step); returns the budget it gave back."""
        scheduled = {s.seq.seq_id: s for s in out.scheduled}
        given_back = self._preempt(victim, scheduled, out)
        out.scheduled[:] = scheduled.values()
        return given_back

    def _admit_head(self, seq: Sequence, budget: int) -> int | None:
        """Give the head of the queue blocks for its next chunk; returns the chunk's size, or
        None (and changes no blocks) when the free blocks do not cover it or the step's time
        bound leaves it no tokens."""
        if seq.block_table:  # a forked choice: it holds its share of the prompt's blocks already
            n = self._chunk(seq, seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens, budget)
            self._out_of_time = n == 0
            if n == 0 or not self.bm.can_grow(seq, n):
                return None
        else:
            hits = self.bm.match_prefix(seq)
            start = len(hits) * self.bm.block_size
            n = self._chunk(seq, start, seq.num_tokens - start, budget)
            self._out_of_time = n == 0
            if n == 0 or not self.bm.can_admit(seq, hits, n):
                return None
            self.bm.admit(seq, hits)
        self.bm.grow(seq, n)
        return n

    def fork(self, parent: Sequence, children: list[Sequence], state_at: int | None = None) -> None:
        """The other choices of ``parent``'s request (SamplingParams.n), once its prompt's KV is
        written: each child takes references on the prompt's full blocks and waits at the head of
        the queue to compute the rest itself, at least the last prompt token, whose logits give
        its own first token. The prompt is prefilled once whether prefix caching is on or off.
        With a recurrent state (``bm.state_slots``), a child shares them only where the parent's state
        (at ``state_at`` after this step) is at their end: it takes a slot and a copy of that state
        (the engine forks there, ``Sequence.checkpoint_at``); else it waits unadmitted, to compute all."""
        shared = self.bm.shared_prefix(parent, (parent.num_prompt_tokens - 1) // self.bm.block_size)
        slots = self.bm.state_slots
        for child in reversed(children):  # the parent's prompt and limits: it fits as the parent did
            if slots is None:
                self.bm.admit(child, shared)
            elif shared and state_at == len(shared) * self.bm.block_size and slots.num_free:
                self.bm.admit(child, shared)
                slots.copy(parent, child)
            self.waiting.appendleft(child)
            self.shares.join(child)

    # ---- after the model ran ----------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: list[int] | list[list[int]]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens (per sampling sequence, in
        ``out.sampling_seqs`` order: one token, or the run a verification kept), publish full
        blocks of committed tokens, return the slots of rejected drafts and finish sequences that
        are done. A run ends at the first token that ends the sequence (EOS, a stop id, a length
        limit), exactly where plain decoding would have stopped. Returns the sampling sequences."""
        sampling = out.sampling_seqs
        assert len(sampling) == len(sampled), (len(sampling), len(sampled))
        commit = self.bm.commit
        for s in out.scheduled:
            if not s.samples:
                s.seq.num_computed_tokens += s.num_tokens
                commit(s.seq)
        now = time.monotonic()
        verified = {s.seq.seq_id: 1 + len(s.drafts) for s in out.scheduled if s.drafts}  # rows
        for seq, tokens in zip(sampling, sampled, strict=True):
            reason, start = None, seq.num_computed_tokens
            for token in [tokens] if isinstance(tokens, int) else tokens:
                seq.token_ids.append(token)
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            seq.num_computed_tokens = len(seq.token_ids) - 1  # the KV of every token but the newest
            commit(seq)
            self.bm.trim(seq, seq.num_tokens)  # blocks that held only rejected drafts
            kept = seq.num_computed_tokens - start  # rows of this step whose tokens stay
            if kept < verified.get(seq.seq_id, 0) and self.bm.state_slots is not None:
                self.bm.state_slots.rollback(seq, kept)  # the recurrent state's side of the trim
            if seq.times.first_token is None:
                seq.times.first_token = now
            if reason is not None:
                self.finish(seq, reason)
        return sampling

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        num_tokens = len(seq.token_ids)
        completion = num_tokens - seq.num_prompt_tokens
        if completion >= p.min_tokens and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            return FinishReason.STOP
        limit = self.max_new_tokens(seq)
        if completion >= limit or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence in any state and return its blocks to the pool."""
        if seq.status == SequenceStatus.FINISHED:
            if reason.replaces(seq.finish_reason):
                seq.finish_reason = reason
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.shares.leave(seq)
        elif seq in self.waiting:  # else never handed over: still compiling, or a choice not forked yet
            self.waiting.remove(seq)
            self.shares.leave(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
