"""Structured output: constraints compiled with xgrammar, one matcher per constrained sequence,
and the allowed-token bitmask applied to the logits before the sampler sees them.

- ``GrammarCompiler`` (one per process) turns a ``Constraint`` (engine/constraints.py) into
  xgrammar's compiled grammar over this model's vocabulary. Compiled grammars are cached by
  (kind, text), so a schema that many requests share is compiled once. A constraint that does
  not compile raises ValueError naming its field and xgrammar's message.
- ``StructuredOutput`` (one per engine) compiles on a thread of its own, never on the engine's
  loop: the engine hands a constrained request over with ``submit`` and schedules it once
  ``take_compiled`` returns it, so prefill and decode steps of other requests go on meanwhile.
  Each constrained sequence then has a ``GrammarMatcher``; every step, ``mask_logits`` fills
  the bitmask rows of the constrained sequences (batched: one bitmask, one in-place apply)
  and ``advance`` feeds each sampled token to its matcher.

The engine's EOS ids are the grammar's stop tokens: the mask allows EOS only where the output
is complete. A matcher only moves when a token is sampled, never when KV is recomputed, so its
state survives preemption. With tensor parallelism only rank 0 runs the engine (and samples),
so only rank 0 holds matchers.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import xgrammar as xgr

from kvserve.engine.constraints import Constraint
from kvserve.engine.sequence import Sequence

GRAMMAR_CACHE_SIZE = 64
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the client needs what follows
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarCompiler:
    """xgrammar's compiler for one vocabulary, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of ``c`` (cached); ValueError naming the field when it does not compile."""
        grammar = self._cache.get(c.key)
        if grammar is None:
            grammar = self._compile(c)
            self._cache[c.key] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(c.key)
        return grammar

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        try:
            if c.kind == "json_schema":
                # compact JSON: a small model offered free whitespace may spend its tokens on it
                return self._compiler.compile_json_schema(c.text, any_whitespace=False)
            if c.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "regex":
                return self._compiler.compile_regex(c.text)
            if c.kind == "grammar":
                return self._compiler.compile_grammar(c.text)
            return self._compiler.compile_grammar(choice_grammar(c.choices))
        except RuntimeError as e:  # xgrammar reports every parse / conversion error this way
            message = _LOG_PREFIX.sub("", str(e).strip()).strip()
            raise ValueError(f"{c.kind}: does not compile: {message}") from None


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(s) for s in choices)


def _ebnf_literal(s: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = [escapes.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x20 else ch) for ch in s]
    return '"' + "".join(out) + '"'


@dataclass
class _Compiling:
    item: object  # whatever the engine submitted with the constraint (its request)
    future: Future


class StructuredOutput:
    """The engine's structured-output state: compiles in flight and a matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: GrammarCompiler | None = None  # built on first use (about 1 s for the vocabulary)
        self._compile_lock = threading.Lock()  # the grammar thread and direct callers share the cache
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
        self._compiling: list[_Compiling] = []
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None

    # ---- compiling, off the engine's loop ---------------------------------------------------------
    def compile(self, c: Constraint) -> xgr.CompiledGrammar:
        """Compile now, in the calling thread (cached)."""
        with self._compile_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self._stop_token_ids)
            return self._compiler.compile(c)

    def submit(self, item: object, c: Constraint) -> None:
        """Compile ``c`` on the grammar thread; ``item`` comes back from ``take_compiled``."""
        self._compiling.append(_Compiling(item, self._pool.submit(self.compile, c)))

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
        """Forget a submitted item (its request was aborted)."""
        self._compiling = [c for c in self._compiling if c.item is not item]

    # ---- matchers ----------------------------------------------------------------------------------
    def is_constrained(self, seq: Sequence) -> bool:
        """Whether ``seq`` samples under a grammar (such sequences do not draft)."""
        return seq.seq_id in self._matchers

    def attach(self, seq: Sequence, grammar: xgr.CompiledGrammar) -> None:
        self._matchers[seq.seq_id] = xgr.GrammarMatcher(grammar)

    def detach(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def mask_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in place, every logit a constrained row's grammar does not allow next."""
        if not self._matchers:
            return
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self._matchers]
        if not rows:
            return
        bitmask = self._bitmask_rows(len(seqs))
        for i in rows:
            self._matchers[seqs[i].seq_id].fill_next_token_bitmask(bitmask, i)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def advance(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Feed each constrained row's sampled token to its matcher. Returns the sequences whose
        grammar refused it: a dead end, where the mask allowed no token of this vocabulary at all
        (e.g. a vocabulary that cannot spell the next character the grammar needs)."""
        if not self._matchers:
            return []
        refused = []
        for seq, token in zip(seqs, token_ids, strict=True):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is not None and not matcher.accept_token(token):
                refused.append(seq)
        return refused

    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            size = max(rows, 2 * (self._bitmask.shape[0] if self._bitmask is not None else 8))
            self._bitmask = xgr.allocate_token_bitmask(size, self.vocab_size)
            if torch.cuda.is_available():
                self._bitmask = self._bitmask.pin_memory()
        return self._bitmask[:rows]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
