"""The prompt-lookup index: the same proposals as a brute-force search over the context, fed
one token at a time or in bulk."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.spec_decode.ngram import NgramIndex


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for follower in range(end - 1, n - 1, -1):  # the most recent earlier occurrence
            if tokens[follower - n : follower] == suffix:
                copied = list(tokens)  # copy on from the follower, the copy's own tokens included
                for i in range(k):
                    copied.append(copied[follower + i])
                return copied[end:], n
    return [], 0


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 3), (2, 5), (3, 3)])
def test_proposals_equal_a_brute_force_search(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(150):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 50))]
        index = NgramIndex(min_n, max_n)
        start = rng.randrange(1, len(tokens) + 1)  # a prompt in bulk, then one token at a time
        for end in range(start, len(tokens) + 1):
            assert index.propose(tokens[:end], 4) == _brute_force(tokens[:end], min_n, max_n, 4)


def test_copied_text_is_proposed_and_fresh_text_is_not():
    index = NgramIndex(2, 5)
    prompt = [5, 6, 7, 8, 9, 10, 11, 1, 2]
    assert index.propose(prompt + [6, 7], 3) == ([8, 9, 10], 2)
    assert index.propose(prompt + [6, 7, 8, 9, 10, 11, 12], 3) == ([], 0)


def test_a_recent_match_repeats_its_period_up_to_k_drafts():
    index = NgramIndex(2, 3)
    assert index.propose([7, 0, 0, 0], 4) == ([0, 0, 0, 0], 2)  # a run of one token
    assert index.propose([9, 1, 2, 3, 1, 2, 3, 1, 2], 5) == ([3, 1, 2, 3, 1], 3)  # a loop of three


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(3, 2)


def test_uncommitted_tokens_after_the_context_extend_the_match_but_not_the_index():
    index = NgramIndex(2, 3)
    tokens = [5, 6, 7, 8, 9, 1, 2]
    assert index.propose(tokens, 3, after=[5, 6]) == ([7, 8, 9], 2)  # matched on the forced [5, 6]
    assert index.propose(tokens, 3, after=[6, 7, 8]) == ([9, 1, 2], 3)
    assert index.propose(tokens + [5, 6], 3) == ([7, 8, 9], 2)  # the index took only committed tokens
    assert index.propose(tokens, 3, after=[4, 4]) == ([], 0)
    assert index.propose(tokens, 4, after=[8, 9]) == ([1, 2, 8, 9], 2)  # on through the forced tokens
