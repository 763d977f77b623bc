"""A request as the engine core keeps it: its ``n`` choices (each a ``Sequence``; choice 0 is the
one that is prefilled, the others fork from it), how many are still running, and the detokenizers
when the core detokenizes. Choice ``i`` samples with seed ``seed + i`` (``choice_params``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
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

