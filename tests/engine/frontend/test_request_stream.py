"""Stream coalescing (engine/frontend/request_stream.py): a reader that keeps up gets each step's delta
on its own; one that fell behind gets the waiting deltas as one, in order, ending with the
finished one; an error comes after the outputs that arrived before it; closing early aborts."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.frontend.request_stream import RequestStream
from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sequence import FinishReason, SequenceTimes


def delta(tok: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("k", [tok], f"<{tok}>", [TokenLogprobs(tok, -0.1 * tok)], finished,
                         FinishReason.LENGTH if finished else None, 3, tok, 0, SequenceTimes())


def test_a_reader_that_keeps_up_gets_every_delta_alone_and_a_late_one_gets_them_merged():
    closed = []

    async def run():
        stream = RequestStream("k", lambda key, finished: closed.append((key, finished)))
        stream.push(delta(1))
        first = await anext(stream)
        for tok in (2, 3, 4):
            stream.push(delta(tok))
        stream.push(delta(5, finished=True))
        merged = await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return first, merged

    first, merged = asyncio.run(run())
    assert first.new_token_ids == [1] and first.new_text == "<1>"
    assert merged.new_token_ids == [2, 3, 4, 5] and merged.new_text == "<2><3><4><5>"
    assert [lp.token_id for lp in merged.new_logprobs] == [2, 3, 4, 5]
    assert merged.finished and merged.finish_reason == FinishReason.LENGTH and merged.completion_tokens == 5
    assert closed == [("k", True)]


def test_an_error_follows_the_outputs_before_it_and_an_early_close_reports_unfinished():
    closed = []

    async def run():
        stream = RequestStream("k", lambda key, finished: closed.append((key, finished)))
        stream.push(delta(1))
        stream.fail(RuntimeError("gone"))
        got = await anext(stream)
        with pytest.raises(RuntimeError, match="gone"):
            await anext(stream)
        other = RequestStream("o", lambda key, finished: closed.append((key, finished)))
        other.push(delta(1))
        other.close()
        return got

    assert asyncio.run(run()).new_token_ids == [1]
    assert closed == [("k", False), ("o", False)]
