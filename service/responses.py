"""Engine outputs -> gRPC messages: stream deltas, whole completions, stats snapshots."""

from __future__ import annotations

import time

from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sequence import FinishReason, SequenceTimes
from kvserve.v1 import llm_pb2


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    if reason is None:
        return llm_pb2.FINISH_REASON_UNSPECIFIED
    return llm_pb2.FinishReason.Value(reason.name)


def logprobs_to_proto(logprobs: list[TokenLogprobs]) -> list[llm_pb2.TokenLogprob]:
    return [
        llm_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[llm_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in logprobs
    ]


def usage_of(out: RequestOutput) -> llm_pb2.Usage:
    return llm_pb2.Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
    )


def timing_of(times: SequenceTimes, arrival: float) -> llm_pb2.Timing:
    """Milliseconds from ``arrival`` (when the service received the call, time.monotonic())."""
    finished = times.finished if times.finished is not None else time.monotonic()

    def ms(t: float | None) -> float:
        return ((t if t is not None else finished) - arrival) * 1000.0

    return llm_pb2.Timing(
        queue_ms=ms(times.first_scheduled), ttft_ms=ms(times.first_token), total_ms=ms(finished)
    )


def stream_response(request_id: str, out: RequestOutput, arrival: float) -> llm_pb2.StreamResponse:
    msg = llm_pb2.StreamResponse(
        request_id=request_id,
        text=out.new_text,
        token_ids=out.new_token_ids,
        logprobs=logprobs_to_proto(out.new_logprobs),
    )
    if out.finished:
        msg.finish_reason = finish_reason_to_proto(out.finish_reason)
        msg.usage.CopyFrom(usage_of(out))
        msg.timing.CopyFrom(timing_of(out.times, arrival))
    return msg


class CompletionBuilder:
    """Accumulates a request's deltas into one GenerateResponse."""

    def __init__(self, request_id: str, arrival: float):
        self.response = llm_pb2.GenerateResponse(request_id=request_id)
        self._arrival = arrival
        self._text: list[str] = []

    def add(self, out: RequestOutput) -> None:
        self._text.append(out.new_text)
        self.response.token_ids.extend(out.new_token_ids)
        self.response.logprobs.extend(logprobs_to_proto(out.new_logprobs))
        if out.finished:
            self.response.text = "".join(self._text)
            self.response.finish_reason = finish_reason_to_proto(out.finish_reason)
            self.response.usage.CopyFrom(usage_of(out))
            self.response.timing.CopyFrom(timing_of(out.times, self._arrival))


def stats_response(stats: dict) -> llm_pb2.StatsResponse:
    """Copy the keys the proto knows (``engine.stats()`` may carry more)."""
    return _message_from(llm_pb2.StatsResponse, stats)


def model_info_response(info: dict) -> llm_pb2.ModelInfoResponse:
    return _message_from(llm_pb2.ModelInfoResponse, info)


def _message_from(cls, values: dict):
    names = {f.name for f in cls.DESCRIPTOR.fields}
    return cls(**{k: v for k, v in values.items() if k in names})
