"""Sample-then-match: the sampling rows of a verification step, and the tokens it keeps.

A sequence verifying drafts d1..dk is computed as k + 1 query rows (its last token, then each
draft); row j gives the logits of the position after d1..dj. Each row is sampled with the full
chain, as a sequence whose tokens are the committed ones followed by d1..dj (``DraftView``): the
penalties count the earlier drafts, min_tokens counts them, a seeded draw is keyed by the row's
absolute position, a constrained row is masked with its grammar's state after d1..dj
(``structured/drafts.py``). The drafts are kept while the sampled token equals them; the first
mismatch contributes its sampled token, and when all k match the last row's sample is the bonus
token.
Every emitted token is thus the one plain decoding would have sampled at that position from the
same logits, whatever the drafts were.
"""

from __future__ import annotations

from kvserve.engine.sequence import Sequence


class DraftView:
    """What the sampler reads of a sequence, as it would be after the drafts ``drafts``."""

    # matches no sequence: the grammar's rows for drafts are filled from ``seq`` and ``drafts``
    # (structured/drafts.py: fill_rows)
    seq_id = -1

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.seq = seq
        self.params = seq.params
        self.request_id = seq.request_id
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.drafts = drafts

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.drafts)

    @property
    def num_completion_tokens(self) -> int:
        return self.seq.num_completion_tokens + len(self.drafts)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.seq.completion_token_ids + self.drafts


def sampling_rows(scheduled: list) -> tuple[list, list[int]]:
    """(the rows to sample, in logits order; per sampling sequence its number of rows)."""
    rows: list = []
    counts: list[int] = []
    for s in scheduled:
        if not s.samples:
            continue
        rows.append(s.seq)
        rows.extend(DraftView(s.seq, s.drafts[:j]) for j in range(1, len(s.drafts) + 1))
        counts.append(1 + len(s.drafts))
    return rows, counts


def accepted_run(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification emits: the sampled tokens up to and including the first one that
    differs from its draft (all k + 1 when every draft matched)."""
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return sampled[: j + 1]
    return sampled[: len(drafts) + 1]
