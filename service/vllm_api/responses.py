"""Engine outputs -> vLLM ``GenerateResponse`` messages: a chunk per delta (stream = true) and
one ``complete`` per choice, with the usage (``cached_tokens`` included), logprobs, the finish
reason as vLLM spells it and the stop that matched."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sequence import FinishReason
from kvserve.vllm import vllm_engine_pb2 as pb

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


def output_logprobs(logprobs: list[TokenLogprobs], top: int | None) -> pb.OutputLogProbs | None:
    """The chosen tokens' log-probabilities and ``top`` alternatives each (None: not asked)."""
    if top is None or not logprobs:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[pb.TopLogProbs(values=[v for _, v in lp.top[:top]],
                                     token_ids=[t for t, _ in lp.top[:top]]) for lp in logprobs],
    )


def chunk(out: RequestOutput, top: int | None) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=out.new_token_ids, prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens, output_logprobs=output_logprobs(out.new_logprobs, top),
        index=out.index,
    ))


@dataclass
class Choice:
    """One choice's tokens and logprobs so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.last = out


def complete(choice: Choice, index: int, top: int | None, stop_token_ids: list[int], whole: bool,
             reason: str | None = None) -> pb.GenerateResponse:
    """The end of choice ``index``, with its whole output when ``whole`` (stream = false; the
    chunks carried it otherwise); ``reason`` overrides the engine's (an aborted call)."""
    last = choice.last
    msg = pb.GenerateComplete(
        output_ids=choice.token_ids if whole else [], index=index,
        finish_reason=reason or FINISH_REASONS.get(last.finish_reason if last else None, "abort"),
        prompt_tokens=last.prompt_tokens if last else 0,
        completion_tokens=last.completion_tokens if last else 0,
        cached_tokens=last.cached_tokens if last else 0,
        output_logprobs=output_logprobs(choice.logprobs, top) if whole else None,
    )
    if reason is None and last is not None:
        if last.finish_reason == FinishReason.STOP_STRING and last.stop_str is not None:
            msg.matched_stop_str = last.stop_str  # the front-end's detokenizer found it
        elif last.finish_reason == FinishReason.STOP and last.new_token_ids and \
                last.new_token_ids[-1] in stop_token_ids:
            msg.matched_token_id = last.new_token_ids[-1]
    return pb.GenerateResponse(complete=msg)
