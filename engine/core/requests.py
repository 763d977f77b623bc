"""A request as the engine core keeps it: its ``n`` choices (each a ``Sequence``; choice 0 is the
one that is prefilled, the others fork from it), how many are still running, and the detokenizers
when the core detokenizes. Choice ``i`` samples with seed ``seed + i`` (``choice_params``); a
step's delta of a choice is a ``RequestOutput`` (``choice_output``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.engine.outputs import RequestOutput, TokenLogprobs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_decode.speculator import spec_usage
from kvserve.engine.tokenizer.detokenizer import RequestText


@dataclass
class Choice:
    """One of a request's n completions."""

    seq: Sequence
    index: int = 0


@dataclass
class Request:
    request_id: str
    choices: list[Choice]
    unfinished: int = 0  # choices that have not finished yet
    text: RequestText | None = None  # the detokenizers, when this engine detokenizes

    @property
    def seq(self) -> Sequence:
        """Choice 0, the one that is prefilled."""
        return self.choices[0].seq


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of a request samples with its own seed stream, ``seed + index``."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def choice_output(choice: Choice, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
    """The delta of ``choice``: its new tokens (and their log-probabilities) and where it stands."""
    seq = choice.seq
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=tokens,
        new_text="",
        new_logprobs=logprobs,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        prompt_tokens=seq.num_prompt_tokens,
        completion_tokens=seq.num_completion_tokens,
        cached_tokens=seq.num_cached_prompt_tokens or 0,
        times=seq.times,
        index=choice.index,
        draft_tokens=spec_usage(seq)[0],
        accepted_draft_tokens=spec_usage(seq)[1],
    )
