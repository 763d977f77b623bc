"""The scheduler's checks of a request before it is queued: that it could ever run (``check_fits``:
max_model_len, the whole KV cache, min_tokens), that its tenant may queue more and that it can start
and finish before its deadline (``check_admission``: engine/tenancy/deadlines.py), and how many tokens
it may make. A base of ``Scheduler`` (engine/core/scheduler.py), which holds the state these read."""

from __future__ import annotations

from kvserve.engine.sequence import Sequence
from kvserve.engine.tenancy.deadlines import check_deadline, check_finish, start_delay


class AdmissionChecks:
    def _longest_fitting(self, limit: int) -> int:
        """The most tokens (up to ``limit``) a sequence may reach with the whole cache to itself."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.bm.peak_blocks(mid, self.max_num_batched_tokens) <= self.bm.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def check_admission(self, seq: Sequence) -> None:
        """Refuse a request (not added yet) whose tenant has its cap of requests waiting
        (``TenantLimit``), or that cannot start or finish before its deadline by the step time model,
        or whose row would make an admitted request miss its own (``DeadlineUnreachable``:
        engine/tenancy/deadlines.py; the fair policy only: ``fcfs`` queues as before)."""
        self.shares.check_queue(seq)
        if not self.shares.fair or seq.tenancy.deadline is None:
            return
        # steps of decode rows, priced at a decode row's pair cost (StepTimeModel.row_coef)
        coef = self.step_clock.row_coef if self.step_clock else None
        if coef is None:  # no step seen yet: only a deadline already past
            check_deadline(seq, 0.0)
            return

        def remaining(r: Sequence) -> int:
            return self.max_new_tokens(r) - r.num_completion_tokens

        delay = start_delay(self.waiting, self.running, seq, self.max_num_seqs, self.max_num_batched_tokens,
                            coef, remaining, lambda r: self.shares.outranks(seq, r))
        check_deadline(seq, delay)
        check_finish(seq, delay, self.waiting, self.running, self.max_num_seqs, coef, remaining)

    def max_new_tokens(self, seq: Sequence) -> int:
        """``max_tokens``, or when it is unset as many as fit: up to max_model_len, and no more
        than the whole KV cache holds (a sequence larger than the cache could never run)."""
        if seq.params.max_tokens is not None:
            return seq.params.max_tokens
        return self.max_seq_len - seq.num_prompt_tokens

    def check_fits(self, seq: Sequence) -> None:
        """Refuse a request that could never run, rather than let it wait forever."""
        new = self.max_new_tokens(seq)
        if seq.params.min_tokens > new:  # unreachable: EOS would be masked until max_model_len ended it
            raise ValueError(f"min_tokens ({seq.params.min_tokens}) exceeds the {new} tokens this request "
                             f"may generate (max_tokens, or what max_model_len ({self.max_model_len}) and "
                             f"the KV cache leave after its {seq.num_prompt_tokens}-token prompt)")
        if seq.params.max_tokens is None and new < 1:
            raise ValueError(f"prompt ({seq.num_prompt_tokens} tokens) leaves no room for a completion: "
                             f"max_model_len ({self.max_model_len}) and the KV cache allow "
                             f"{self.max_seq_len} tokens")
        total = seq.num_prompt_tokens + new
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        need = self.bm.peak_blocks(total, self.max_num_batched_tokens)
        if need > self.bm.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks but the whole cache has {self.bm.num_blocks}"
            )
