"""Engine outputs -> gRPC messages: stream deltas, whole completions, stats snapshots."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvserve.engine.frontend.engine_state import EngineInfo, ServerStats
from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sequence import FinishReason, SequenceTimes
from kvserve.v1 import llm_pb2


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    if reason is None:
        return llm_pb2.FINISH_REASON_UNSPECIFIED
    return llm_pb2.FinishReason.Value(reason.name)


TokenText = Callable[[int], str]  # token id -> its text decoded alone


def logprobs_to_proto(logprobs: list[TokenLogprobs], token_text: TokenText) -> list[llm_pb2.TokenLogprob]:
    return [
        llm_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            token=token_text(lp.token_id),
            top=[llm_pb2.TopLogprob(token_id=t, logprob=v, token=token_text(t)) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def usage_of(out: RequestOutput) -> llm_pb2.Usage:
    return llm_pb2.Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        draft_tokens=out.draft_tokens,
        accepted_draft_tokens=out.accepted_draft_tokens,
    )


def timing_of(times: SequenceTimes, arrival: float) -> llm_pb2.Timing:
    """Milliseconds from ``arrival`` (when the service received the call, time.monotonic())."""
    finished = times.finished if times.finished is not None else time.monotonic()

    def ms(t: float | None) -> float:
        return ((t if t is not None else finished) - arrival) * 1000.0

    return llm_pb2.Timing(
        queue_ms=ms(times.first_scheduled), ttft_ms=ms(times.first_token), total_ms=ms(finished)
    )


def stream_response(
    request_id: str, out: RequestOutput, arrival: float, token_text: TokenText
) -> llm_pb2.StreamResponse:
    msg = llm_pb2.StreamResponse(
        request_id=request_id,
        text=out.new_text,
        token_ids=out.new_token_ids,
        logprobs=logprobs_to_proto(out.new_logprobs, token_text),
        index=out.index,
    )
    if out.finished:
        msg.finish_reason = finish_reason_to_proto(out.finish_reason)
        msg.usage.CopyFrom(usage_of(out))
        msg.timing.CopyFrom(timing_of(out.times, arrival))
    return msg


class CompletionBuilder:
    """Accumulates a request's deltas (of its n choices) into one GenerateResponse: choice 0 in
    the top-level fields, every choice in ``choices`` when n > 1 (see llm.proto)."""

    def __init__(self, request_id: str, arrival: float, token_text: TokenText, n: int = 1):
        self._request_id = request_id
        self._arrival = arrival
        self._token_text = token_text
        self._choices = [llm_pb2.Choice(index=i) for i in range(n)]
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._times: list[SequenceTimes | None] = [None] * n  # each choice's, once finished

    def add(self, out: RequestOutput) -> None:
        choice = self._choices[out.index]
        self._text[out.index].append(out.new_text)
        choice.token_ids.extend(out.new_token_ids)
        choice.logprobs.extend(logprobs_to_proto(out.new_logprobs, self._token_text))
        if out.finished:
            choice.text = "".join(self._text[out.index])
            choice.finish_reason = finish_reason_to_proto(out.finish_reason)
            choice.usage.CopyFrom(usage_of(out))
            self._times[out.index] = out.times

    @property
    def response(self) -> llm_pb2.GenerateResponse:
        first = self._choices[0]
        msg = llm_pb2.GenerateResponse(
            request_id=self._request_id, text=first.text, token_ids=first.token_ids,
            finish_reason=first.finish_reason, logprobs=first.logprobs,
        )
        msg.usage.CopyFrom(first.usage)
        if len(self._choices) > 1:
            msg.choices.extend(self._choices)
            msg.usage.completion_tokens = sum(c.usage.completion_tokens for c in self._choices)
        if all(t is not None for t in self._times):
            # choice 0 was prefilled: its queue and first-token times are the request's
            msg.timing.CopyFrom(timing_of(self._times[0], self._arrival))
            msg.timing.total_ms = max(timing_of(t, self._arrival).total_ms for t in self._times)
        return msg


def stats_response(stats: ServerStats) -> llm_pb2.StatsResponse:
    """The Stats message; every field of it is a field of ``ServerStats`` (tests/service hold it so),
    which may carry more (the speculative and prefix-cache counters /metrics exports)."""
    return _message_from(llm_pb2.StatsResponse, stats)


def model_info_response(info: EngineInfo) -> llm_pb2.ModelInfoResponse:
    return _message_from(llm_pb2.ModelInfoResponse, info.facts, has_chat_template=info.has_chat_template)


def _message_from(cls, struct: msgspec.Struct, **more):
    """``cls`` with each of its fields taken from the attribute of that name (AttributeError when
    the struct lacks one: a renamed field fails loudly instead of going missing)."""
    fields = {f.name: getattr(struct, f.name) for f in cls.DESCRIPTOR.fields if f.name not in more}
    return cls(**fields, **more)
