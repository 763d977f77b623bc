"""What the sampler reads of a step's rows, gathered once per step (``SamplingBatch.of``): the
sampler's stages then see plain per-row values, never a request object."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingBatch:
    """A step's sampled rows as the sampler reads them, gathered once (``Sampler.prepare``): one
    entry per row of logits, plain host values; the token histories only for rows with a penalty
    that reads them (else None)."""

    greedy: list[bool]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    repetition_penalties: list[float]
    presence_penalties: list[float]
    frequency_penalties: list[float]
    seeds: list[int | None]
    positions: list[int]  # the absolute position of the token drawn (a seeded draw's key)
    num_logprobs: list[int]
    seen_tokens: list[list[int] | None]  # prompt and output: the repetition penalty's
    output_tokens: list[list[int] | None]  # output only: presence and frequency penalties'
    forbidden: list[list[int]]  # ids that would end a request still under min_tokens

    def __len__(self) -> int:
        return len(self.greedy)

    def has_penalty(self, i: int) -> bool:
        return (self.repetition_penalties[i] != 1.0 or self.presence_penalties[i] != 0.0
                or self.frequency_penalties[i] != 0.0)

    @classmethod
    def of(cls, seqs: list, eos_token_ids: list[int], vocab_size: int,
           drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The batch of rows sampling ``seqs[i]`` as it would be after ``drafts[i]`` (a
        verification row; None or an empty list: the sequence as it is). Reads each sequence's
        ``params``, ``num_tokens``, ``num_completion_tokens``, ``token_ids`` and
        ``completion_token_ids``; the drafts count as its tokens."""
        ps = [r.params for r in seqs]
        ds = drafts or [()] * len(seqs)
        rows = list(zip(seqs, ps, ds, strict=True))
        return cls(
            greedy=[p.greedy for p in ps], temperatures=[p.temperature for p in ps],
            top_ks=[p.top_k for p in ps], top_ps=[p.top_p for p in ps], min_ps=[p.min_p for p in ps],
            repetition_penalties=[p.repetition_penalty for p in ps],
            presence_penalties=[p.presence_penalty for p in ps],
            frequency_penalties=[p.frequency_penalty for p in ps],
            seeds=[p.seed for p in ps], positions=[r.num_tokens + len(d) for r, _, d in rows],
            num_logprobs=[p.logprobs for p in ps],
            seen_tokens=[_with(r.token_ids, d) if p.repetition_penalty != 1.0 else None for r, p, d in rows],
            output_tokens=[_with(r.completion_token_ids, d) if p.presence_penalty or p.frequency_penalty
                           else None for r, p, d in rows],
            forbidden=[_forbidden(r.num_completion_tokens + len(d), p, eos_token_ids, vocab_size)
                       for r, p, d in rows],
        )


def _with(tokens: list[int], drafts) -> list[int]:
    return tokens + list(drafts) if drafts else tokens


def _forbidden(completion_tokens: int, p, eos_token_ids: list[int], vocab_size: int) -> list[int]:
    """The ids that would end a request still under min_tokens (EOS only where it would end it,
    not under ignore_eos, as in vLLM)."""
    if completion_tokens >= p.min_tokens:
        return []
    ids = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_token_ids)
    return [t for t in ids if 0 <= t < vocab_size]
