"""Sample-then-match: the sampling rows of a verification step, and the tokens it keeps.

A sequence verifying drafts d1..dk is computed as k + 1 query rows (its last token, then each
draft); row j gives the logits of the position after d1..dj. Each row is sampled with the full
chain, as its sequence would be after d1..dj (``SamplingRows``: a row's sequence and drafts): the
penalties count the earlier drafts, min_tokens counts them, a seeded draw is keyed by the row's
absolute position, a constrained row is masked with its grammar's state after d1..dj
(``structured/drafts.py``). The drafts are kept while the sampled token equals them; the first
mismatch contributes its sampled token, and when all k match the last row's sample is the bonus
token.
Every emitted token is thus the one plain decoding would have sampled at that position from the
same logits, whatever the drafts were.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.sequence import Sequence


@dataclass
class SamplingRows:
    """The rows of logits a step samples, in order, as the sampler and the grammar masks read them:
    row i samples ``seqs[i]`` as it would be after ``drafts[i]`` (empty: its own next token; d1..dj:
    a verification row)."""

    seqs: list[Sequence]
    drafts: list[list[int]]
    counts: list[int]  # per sampling sequence, its number of rows

    def __len__(self) -> int:
        return len(self.seqs)


NO_DRAFTS: list[int] = []  # shared by every plain row (never mutated)


def sampling_rows(scheduled: list) -> SamplingRows:
    """The rows of a step's sampling sequences: each one's own, then one per draft."""
    rows = SamplingRows([], [], [])
    for s in scheduled:
        if not s.samples:
            continue
        rows.seqs.append(s.seq)
        rows.drafts.append(NO_DRAFTS)
        for j in range(1, len(s.drafts) + 1):
            rows.seqs.append(s.seq)
            rows.drafts.append(s.drafts[:j])
        rows.counts.append(1 + len(s.drafts))
    return rows


def accepted_run(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification emits: the sampled tokens up to and including the first one that
    differs from its draft (all k + 1 when every draft matched)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[: j + 1]
    return sampled[: len(drafts) + 1]
