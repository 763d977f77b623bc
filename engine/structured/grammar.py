"""Structured output: constraints compiled with xgrammar, one matcher per constrained sequence,
and the allowed-token bitmask applied to the logits before the sampler sees them.

- ``GrammarCompiler`` (one per engine) turns a ``Constraint`` (engine/constraints.py) into
  xgrammar's compiled grammar over this model's vocabulary, in child processes
  (``compile_worker``: ``grammar_compile_workers`` of them, each compile within
  ``grammar_compile_timeout`` seconds, killed when its request goes away). Compiled grammars are
  cached by (kind, text), so a schema that many requests share is compiled once. A constraint
  that does not compile, or not in time, raises ValueError naming its field (and the budget).
- ``StructuredOutput`` (one per engine) compiles on threads of its own, never on the engine's
  loop: the engine hands a constrained request over with ``submit`` and schedules it once
  ``take_compiled`` returns it, so prefill and decode steps of other requests go on meanwhile;
  ``cancel`` stops the compile of a request that went away.
  Each constrained sequence then has a ``GrammarMatcher``; every step, ``mask_logits`` fills
  the bitmask rows of the constrained sequences (batched: one bitmask, one in-place apply; a
  verification's draft rows each with the state after its drafts) and ``advance`` feeds each
  sequence's kept tokens to its matcher. ``draft`` proposes a constrained sequence's speculative
  drafts (the grammar's forced tokens, composed with n-gram drafts: ``drafts.py``).

The engine's EOS ids are the grammar's stop tokens: the mask allows EOS only where the output
is complete. A matcher only moves when a token is sampled, never when KV is recomputed, so its
state survives preemption. With tensor parallelism only rank 0 runs the engine (and samples),
so only rank 0 holds matchers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import xgrammar as xgr

from kvserve.engine.constraints import Constraint
from kvserve.engine.sequence import Sequence
from kvserve.engine.structured import drafts
from kvserve.engine.structured.compile_worker import CompileCancelled, CompileWorker, choice_grammar

GRAMMAR_CACHE_SIZE = 64
__all__ = ["CompileCancelled", "GrammarCompiler", "StructuredOutput", "choice_grammar"]


class GrammarCompiler:
    """Compiles constraints for one vocabulary in child processes (``compile_worker``), at most
    ``workers`` at once (the callers' threads), each within ``timeout_s``; an LRU cache keeps
    compiled grammars. One process more than ``workers`` is kept: a stopped compile's process
    starts afresh (seconds: it imports xgrammar and reads the vocabulary) at the back of the
    line, so the next compile takes the spare, which is ready."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], workers: int = 2,
                 timeout_s: float = 10.0, cache_size: int = GRAMMAR_CACHE_SIZE):
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=list(stop_token_ids))
        vocabulary = self._info.serialize_json().encode()
        self._workers = [CompileWorker(vocabulary) for _ in range(workers + 1)]
        for w in self._workers:
            w.start()  # they load the vocabulary while the first compile is on its way
        self._idle = list(self._workers)
        self._idle_changed = threading.Condition()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def cached(self, c: Constraint) -> xgr.CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(c.key)
            if grammar is not None:
                self._cache.move_to_end(c.key)
            return grammar

    def compile(self, c: Constraint, cancelled: threading.Event | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of ``c`` (cached). ValueError naming the field when it does not
        compile or not within the time budget; CompileCancelled once ``cancelled`` is set."""
        grammar = self.cached(c)
        if grammar is not None:
            return grammar
        worker = self._take_worker()
        try:
            serialized = worker.compile(c, self.timeout_s, cancelled or threading.Event())
        finally:
            with self._idle_changed:
                self._idle.append(worker)
                self._idle_changed.notify()
        grammar = xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        with self._lock:
            self._cache[c.key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _take_worker(self) -> CompileWorker:
        """An idle process, one that is ready when there is one."""
        with self._idle_changed:
            self._idle_changed.wait_for(lambda: self._idle)
            worker = next((w for w in self._idle if w.is_ready()), self._idle[0])
            self._idle.remove(worker)
            return worker

    def shutdown(self) -> None:
        for w in self._workers:
            w.stop()


@dataclass
class _Compiling:
    item: object  # whatever the engine submitted with the constraint (its request)
    future: Future
    cancelled: threading.Event


class StructuredOutput:
    """The engine's structured-output state: compiles in flight and a matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], workers: int = 2,
                 timeout_s: float = 10.0):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._workers, self._timeout_s = workers, timeout_s
        self._compiler: GrammarCompiler | None = None  # built on first use (about 1 s for the vocabulary)
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvserve-grammar")
        self._compiling: list[_Compiling] = []
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None
        self._forced_text = drafts.ForcedText(tokenizer)

    # ---- compiling, off the engine's loop ---------------------------------------------------------
    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self._stop_token_ids,
                                                 self._workers, self._timeout_s)
            return self._compiler

    def compile(self, c: Constraint, cancelled: threading.Event | None = None) -> xgr.CompiledGrammar:
        """Compile now, waiting in the calling thread (cached)."""
        return self.compiler.compile(c, cancelled)

    def submit(self, item: object, c: Constraint) -> None:
        """Compile ``c`` on a grammar thread (at most ``workers`` at once); ``item`` comes back from
        ``take_compiled``. A grammar in the cache is ready at once, behind no compile."""
        cancelled = threading.Event()
        grammar = self._compiler.cached(c) if self._compiler is not None else None
        if grammar is not None:
            future: Future = Future()
            future.set_result(grammar)
        else:
            future = self._pool.submit(self.compile, c, cancelled)
        self._compiling.append(_Compiling(item, future, cancelled))

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def take_compiled(self, wait_s: float = 0.0) -> list[tuple[object, xgr.CompiledGrammar | ValueError]]:
        """The submitted items whose compile ended, with the grammar or the ValueError; waits up
        to ``wait_s`` for the first one when none has ended yet."""
        if wait_s > 0 and self._compiling and not any(c.future.done() for c in self._compiling):
            wait([c.future for c in self._compiling], timeout=wait_s, return_when=FIRST_COMPLETED)
        done, pending = [], []
        for c in self._compiling:  # one done() per item: a compile ending meanwhile is in one list
            (done if c.future.done() else pending).append(c)
        self._compiling = pending
        return [(c.item, c.future.exception() or c.future.result()) for c in done]

    def cancel(self, item: object) -> None:
        """Forget a submitted item (its request was aborted) and stop its compile."""
        for c in self._compiling:
            if c.item is item:
                c.cancelled.set()
                c.future.cancel()
        self._compiling = [c for c in self._compiling if c.item is not item]

    # ---- matchers ----------------------------------------------------------------------------------
    def is_constrained(self, seq: Sequence) -> bool:
        """Whether ``seq`` samples under a grammar (its drafts come from ``draft``)."""
        return seq.seq_id in self._matchers

    def draft(self, seq: Sequence, cap: int, index, forced: bool) -> tuple[list[int], int, int]:
        """(up to ``cap`` drafts, how many lead as forced tokens, the n-gram length behind the others:
        ``drafts.propose``) for a constrained sequence, every one allowed by its grammar in turn:
        ``forced`` whether the grammar's forced tokens take part, ``index`` the sequence's n-gram
        index (None: no n-gram drafts)."""
        return drafts.propose(self._matchers[seq.seq_id], self._forced_text if forced else None, index,
                              seq.token_ids, cap)

    def attach(self, seq: Sequence, grammar: xgr.CompiledGrammar) -> None:
        self._matchers[seq.seq_id] = xgr.GrammarMatcher(grammar)

    def detach(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def mask_logits(self, logits: torch.Tensor, seqs: list,
                    row_drafts: list[list[int]] | None = None) -> None:
        """Set to -inf, in place, every logit a constrained row's grammar does not allow next (row i:
        ``seqs[i]`` after ``row_drafts[i]``, a verification's draft rows included)."""
        if not self._matchers:
            return
        bitmask = self._bitmask_rows(len(seqs))
        rows = drafts.fill_rows(self._matchers, bitmask, seqs, row_drafts)
        if not rows:
            return
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def advance(self, seqs: list[Sequence], runs: list[int] | list[list[int]]) -> list[Sequence]:
        """Feed each constrained sequence's new tokens to its matcher: per sampling sequence one
        sampled token, or the run its verification kept (up to the grammar's stop token, where the
        sequence ends). Returns the sequences whose grammar refused one: a dead end, where the mask
        allowed no token of this vocabulary at all (e.g. a vocabulary that cannot spell the next
        character the grammar needs)."""
        if not self._matchers:
            return []
        refused = []
        for seq, run in zip(seqs, runs, strict=True):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None:
                continue
            for i, token in enumerate([run] if isinstance(run, int) else run):
                if i and matcher.is_terminated():  # a drafted stop token ended the run: the rest is dropped
                    break
                if not matcher.accept_token(token):
                    refused.append(seq)
                    break
        return refused

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            size = max(rows, 2 * (self._bitmask.shape[0] if self._bitmask is not None else 8))
            self._bitmask = xgr.allocate_token_bitmask(size, self.vocab_size)
            if torch.cuda.is_available():
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask[:rows]

    def shutdown(self) -> None:
        for c in self._compiling:
            c.cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:
            self._compiler.shutdown()
