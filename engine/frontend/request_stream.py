"""One request's outputs on the front-end's event loop, coalesced when the reader lags.

The front-end ``push``es each step's delta as it arrives (one wake-up of the reader per step
at most). The reader takes, at each ``__anext__``, everything that arrived since its last
read as one ``RequestOutput``: under light load that is each token's own delta; when the
client or the loop falls behind, the waiting deltas go out together (token ids, text and
logprobs concatenated in order; finish reason, usage and times from the last one). A request
with n completions (SamplingParams.n) has n choices: a read takes one choice's deltas, and the
stream ends after every choice's finished one.

``interval`` (the server's ``--stream-interval``, as SGLang's): above 1 the reader is woken only
once ``interval`` tokens are waiting, and for the first output, a finished one or an error; each
message then carries up to that many tokens. Fewer messages and wake-ups per token, at the cost
of a burstier stream; 1 (the default) releases every delta at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from kvserve.engine.tokenizer.detokenizer import RequestText


class RequestStream:
    """Async iterator over one request's outputs, ending after the finished one.

    ``close()`` (also run when the reader is cancelled while waiting) calls
    ``on_close(key, finished)``: the front-end aborts the request if it has not finished.
    """

    def __init__(self, key: str, on_close: Callable[[str, bool], None], n: int = 1,
                 text: RequestText | None = None, interval: int = 1):
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.key = key
        self.text = text  # the request's detokenizers (the front-end's), which fill each delta's text
        self._on_close = on_close
        self._unfinished = n  # choices whose finished output has not been pushed
        self._pending: list[RequestOutput] = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._done = False  # ... and read
        self._closed = False
        self._interval = interval
        self._read_any = False

    def push(self, out: RequestOutput) -> None:
        self._pending.append(out)
        self._unfinished -= out.finished
        if self._ready():
            self._wake()

    def _ready(self) -> bool:
        """Something is to be read now (see ``interval``)."""
        if self._error is not None:
            return True
        if not self._pending:
            return False
        if self._interval == 1 or not self._read_any or self.finished:
            return True
        tokens = sum(len(o.new_token_ids) for o in self._pending)
        return tokens >= self._interval or any(o.finished for o in self._pending)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (after the outputs that already arrived)."""
        if self._error is None and not self.finished:
            self._error = error
            self._wake()

    @property
    def finished(self) -> bool:
        """The finished output of every choice has been pushed."""
        return self._unfinished == 0

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            self.close()
            raise StopAsyncIteration
        while not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.close()
                raise
        if not self._pending:
            self._done = True
            self.close()
            raise self._error
        self._read_any = True
        pending = self._pending
        index = pending[0].index
        if all(o.index == index for o in pending):  # one choice waiting: all of it
            out, self._pending = coalesce(pending), []
        else:
            out = coalesce([o for o in pending if o.index == index])
            self._pending = [o for o in pending if o.index != index]
        if self.finished and not self._pending:
            self._done = True
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self.key, self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """Several consecutive deltas of one request as one."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outputs),
        new_logprobs=[lp for o in outputs for lp in o.new_logprobs],
        finished=last.finished,
        finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        times=last.times,
        index=last.index,
    )
