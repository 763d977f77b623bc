"""What the engine hands back per step: per-request deltas (new tokens, new text) and,
on the last one, the finish reason and usage. The service and ``LLM.generate`` consume these."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.sequence import FinishReason, SequenceTimes


@dataclass
class TokenLogprobs:
    """Log-probability of a chosen token and the top-N alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]  # one per new token when params.logprobs > 0, else empty
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    times: SequenceTimes  # time.monotonic() stamps: arrival, first_scheduled, first_token, finished
    index: int = 0  # which of the request's n completions (SamplingParams.n) this delta belongs to
    # speculative decoding so far: draft tokens verified for this choice, and how many were accepted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    stop_str: str | None = None  # the stop string that ended the choice (finish_reason STOP_STRING)


@dataclass
class CompletionOutput:
    """A whole completion, as returned by ``LLM.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs]
    cached_tokens: int = 0
    index: int = 0
    draft_tokens: int = 0  # speculative decoding: draft tokens verified for this completion
    accepted_draft_tokens: int = 0  # of which accepted
    times: SequenceTimes | None = None  # the request's time stamps, once it finished
    # all n completions, in index order, when SamplingParams.n > 1 (this object is choice 0)
    choices: list[CompletionOutput] = field(default_factory=list)
