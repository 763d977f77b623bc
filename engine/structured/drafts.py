"""Speculative decoding under a grammar: the drafts of a constrained sequence, and the bitmask rows
that verify them.

Drafting (``propose``). Where the grammar leaves no choice (a JSON schema's keys, the quotes,
colons and commas around them, an enum's one remaining spelling), xgrammar reports the forced
text (``GrammarMatcher.find_jump_forward_string``); the engine's tokenizer encodes it (no special
tokens) and its tokens are the *forced* drafts. They compose with the request's n-gram index
(``spec_decode/ngram.py``) by one rule: of

- (a) the forced tokens, then the n-gram continuation of the context extended by them, and
- (b) the n-gram proposal from the committed context alone,

each cut to its longest grammar-valid prefix, the longer one is proposed (a on a tie). Every
proposal is cut to that prefix (the matcher takes the tokens one by one, then rolls back), so a
draft the grammar forbids is never verified. The server's mode decides which sources take part:
``grammar`` the forced tokens only, ``ngram`` the n-gram proposal only (cut to the grammar),
``all`` both.

Verification (``fill_rows``). A sequence verifying d1..dk has k + 1 sampling rows; row j is
masked with the matcher's state after d1..dj: the matcher takes each draft before filling its
row and rolls back afterwards, so after the step it holds the committed tokens only, and the
engine feeds it the run the verification kept (``StructuredOutput.advance``). The rows are then
masked exactly as plain decoding masks those positions, so the sampled tokens, and their
log-probabilities, are those of plain constrained decoding.

xgrammar 0.2.9's matchers roll back any number of tokens (``max_rollback_tokens`` is deprecated
and always unlimited), so a matcher needs no rollback budget sized to the server's
``num_speculative_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_FORCED_CHARS = 256  # of a forced text, the part tokenized (far more than 16 drafts' worth)
ENCODED_CACHE_SIZE = 1024  # forced texts recur (a schema's keys): their tokens are kept


class ForcedText:
    """Forced text -> the engine tokenizer's tokens for it (no special tokens), cached."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    def tokens(self, matcher) -> list[int]:
        text = matcher.find_jump_forward_string()[:MAX_FORCED_CHARS]
        if not text:
            return []
        ids = self._cache.get(text)
        if ids is None:
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            self._cache[text] = ids
            if len(self._cache) > ENCODED_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return ids


def valid_prefix(matcher, tokens: list[int]) -> int:
    """How many leading ``tokens`` the grammar accepts in turn from the matcher's state (which is
    left as it was). Nothing follows a token that ends the grammar (a stop token)."""
    taken = 0
    try:
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
    finally:
        if taken:
            matcher.rollback(taken)
    return taken


def propose(matcher, forced_text: ForcedText | None, index, tokens: list[int], cap: int
            ) -> tuple[list[int], int, int]:
    """(drafts, how many of them lead as forced tokens, the n-gram length behind the n-gram drafts
    after them (0: none)) for a constrained sequence whose committed tokens are ``tokens``: the
    module's rule. ``forced_text`` None: no forced drafts (mode ``ngram``); ``index`` None: no
    n-gram drafts (mode ``grammar``)."""
    if matcher.is_terminated() or cap <= 0:
        return [], 0, 0
    forced: list[int] = []
    if forced_text is not None:
        forced = forced_text.tokens(matcher)[:cap]
        forced = forced[: valid_prefix(matcher, forced)]
    composed, composed_match = forced, 0
    if index is not None and forced and len(forced) < cap:
        more, composed_match = index.propose(tokens, cap - len(forced), after=forced)
        more = more[: valid_prefix_after(matcher, forced, more)]
        composed, composed_match = forced + more, composed_match if more else 0
    ngram: list[int] = []
    if index is not None:
        ngram, match = index.propose(tokens, cap)
        ngram = ngram[: valid_prefix(matcher, ngram)]
        if len(ngram) > len(composed):
            return ngram, 0, match
    return composed, len(forced), composed_match


def valid_prefix_after(matcher, head: list[int], tail: list[int]) -> int:
    """``valid_prefix`` of ``tail`` from the state after ``head`` (which the grammar accepts)."""
    if not tail:
        return 0
    for token in head:
        matcher.accept_token(token)
    try:
        return valid_prefix(matcher, tail)
    finally:
        matcher.rollback(len(head))


def fill_rows(matchers: dict, bitmask, seqs: list, drafts: list[list[int]] | None = None) -> list[int]:
    """Fill the bitmask row of every constrained sampling row (row i: ``seqs[i]`` after its drafts
    ``drafts[i]``, d1..dj, or none), each with its matcher's state at that position; returns the
    row indices filled. Rows of one sequence come in order (its own, then one per draft). Every
    matcher ends where it started. A draft its grammar refuses (none should reach here:
    ``propose`` cuts them) leaves the rows after it with the previous row's mask: sample-then-match
    never reaches them, since that row's mask forbids the draft."""
    filled: list[int] = []
    taken: dict[int, int] = {}  # seq_id -> drafts its matcher took in this call
    broken: set[int] = set()  # seq_ids whose later rows copy the previous row's mask
    try:
        for i, seq in enumerate(seqs):
            matcher = matchers.get(seq.seq_id)
            if matcher is None:
                continue
            filled.append(i)
            if drafts and drafts[i] and seq.seq_id not in broken:
                if not matcher.is_terminated() and matcher.accept_token(drafts[i][-1]):
                    taken[seq.seq_id] = taken.get(seq.seq_id, 0) + 1
                    if matcher.is_terminated():  # the draft was a stop token: nothing follows it
                        broken.add(seq.seq_id)
                else:
                    broken.add(seq.seq_id)
            if seq.seq_id in broken:
                bitmask[i] = bitmask[i - 1]
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
    finally:
        for seq_id, n in taken.items():
            matchers[seq_id].rollback(n)
    return filled
