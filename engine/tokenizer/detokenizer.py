"""Incremental detokenization of one request's output, with stop strings.

Owns the text side of a running request: token ids go in one at a time, released text
comes out (``IncrementalDetokenizer``; ``RequestText`` holds one per choice and applies them to
the engine's token-id deltas). Two things are held back: bytes of a character that is not complete yet
(tokenizers' ``DecodeStream`` does this, decoding only a small window per token), and text
that could still be the start of a stop string. When a stop string appears, the text
before it is released and everything from the stop string on never is.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvserve.engine.sequence import FinishReason

# prompt tokens decoded ahead of the output so that the first output token is decoded in
# context (leading spaces, merges across the boundary); a few are enough
PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str]):
        self._tokenizer = backend_tokenizer(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        context = self._complete_context(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._context = context  # the last tokens whose text is out of the stream
        self._pending: list[int] = []  # tokens fed to the stream that have not produced text yet
        self._held = ""  # decoded text that may be the start of a stop string
        self._released: list[str] = []
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that ended the text, once stopped

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the newly released text (possibly empty)."""
        if self.stopped:
            return ""
        piece = self._step(token_id)
        if piece is None:
            self._pending.append(token_id)
            return ""
        self._context = (self._context + self._pending + [token_id])[-PROMPT_CONTEXT_TOKENS:]
        self._pending = []
        return self._release(piece, final=False)

    def finish(self) -> str:
        """End of the request: release what was held back (incomplete bytes decode as U+FFFD,
        as in a full decode). A stop string completed here still cuts the text."""
        if self.stopped:
            return ""
        rest = self._decode_pending()
        self._pending = []
        return self._release(rest, final=True)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception:  # tokenizers' "invalid prefix": a decoder that rewrote earlier text
            # the broken stream stays broken; go on with a fresh one from the unreleased tokens
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._tokenizer, self._pending + [token_id])

    def _release(self, piece: str, final: bool) -> str:
        if not self._stop:  # nothing to look for or hold back
            self._released.append(piece)
            return piece
        text = self._held + piece
        cut = first_stop(text, self._stop)
        if cut is not None:
            self.stopped = True
            self.stop_str = next(stop for stop in self._stop if text.startswith(stop, cut))
            out, self._held = text[:cut], ""
        else:
            keep = 0 if final else stop_prefix_length(text, self._stop)
            out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self._released.append(out)
        return out

    def _decode_pending(self) -> str:
        if not self._pending:
            return ""
        before = self._decode(self._context)
        full = self._decode(self._context + self._pending)
        return full[len(before) :] if full.startswith(before) else self._decode(self._pending)

    def _complete_context(self, context: list[int]) -> list[int]:
        """Drop trailing prompt tokens that end inside a character: seeded with such a
        prefix, ``DecodeStream`` would hand the prompt's own text back with the first output."""
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def backend_tokenizer(tokenizer) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"need a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
    return backend


def first_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string in ``text`` begins, or None."""
    found = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(found) if found else None


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while i != -1 and len(text) - i > best:
            if stop.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(stop[0], i + 1)
    return best


class RequestText:
    """The text side of one request's n choices (SamplingParams.n): a detokenizer each. ``process``
    fills a step's token-id delta with its text; when a stop string appears it ends the choice
    there (finished, STOP_STRING, the text cut before the stop string), and deltas of a choice
    that ended here are dropped after that.

    In process, ``LLMEngine`` runs this right after each step and finishes the sequence at once;
    under the service the front-end runs it and tells the engine core to stop the choice, as
    vLLM's V1 front-end does: the core may compute a token or two more, which nobody sees."""

    KEEP, STOPPED, DROP = "keep", "stopped", "drop"

    def __init__(self, tokenizer, prompt_token_ids: list[int], params):
        self._detoks = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop)
            for _ in range(params.n)
        ]
        self._ended = [False] * params.n

    def process(self, out) -> str:
        """Set ``out.new_text`` (and end the choice on a stop string); returns KEEP, STOPPED (a stop
        string ended the choice in this delta: ``out`` says so) or DROP (the choice had ended)."""
        if self._ended[out.index]:
            return self.DROP
        detok = self._detoks[out.index]
        if not out.new_token_ids:  # an abort's output: nothing more is released
            self._ended[out.index] = out.finished
            return self.KEEP
        # the EOS / stop token that ended the request is reported as a token, not as text; so is the
        # token its constraint refused (an ABORT)
        ended_by_token = out.finish_reason in (FinishReason.STOP, FinishReason.ABORT)
        pieces = []
        # a delta may hold several tokens (a speculative run): a stop string completed inside it
        # ends the output at the token that completed it, as plain decoding would have
        for j, token in enumerate(out.new_token_ids[:-1] if ended_by_token else out.new_token_ids):
            pieces.append(detok.add(token))
            if detok.stopped:
                _keep_tokens(out, j + 1)
                break
        text = "".join(pieces)
        verdict = self.KEEP
        if detok.stopped:  # also when this token hit max_tokens: the stop string ended the text
            out.finished, out.finish_reason, verdict = True, FinishReason.STOP_STRING, self.STOPPED
            out.stop_str = detok.stop_str
        elif out.finished:
            text += detok.finish()
        out.new_text = text
        self._ended[out.index] = out.finished
        return verdict


def _keep_tokens(out, count: int) -> None:
    """Cut a delta to its first ``count`` tokens (their logprobs and the usage with them)."""
    dropped = len(out.new_token_ids) - count
    if dropped:
        out.new_token_ids = out.new_token_ids[:count]
        out.new_logprobs = out.new_logprobs[:count]
        out.completion_tokens -= dropped
