"""Prompt lookup: the tokens that followed the last earlier occurrence of the context's suffix.

One ``NgramIndex`` per sequence (never shared: a pool across requests would let one tenant's
prompt shape another's timing). For each n-gram length n in [min_n, max_n] a dict maps the
n-gram (hashed) to the position of the token that followed its most recent occurrence. The index
is fed each new token as it is committed (``extend``): an n-gram enters once its follower exists,
at a cost of (max_n - min_n + 1) tuple hashes per token, whatever the context length. A lookup
(``propose``) is at most that many dict probes, longest n first.

Where the match is recent, fewer than k tokens follow it before the context ends: the text is then
repeating with a period of (context length - follower position) tokens (a loop, a run of one
character, a list of like lines), and the drafts go on through that period (each draft is the token
one period before it), as a copy of the context's continuation would.

Cost, measured on this machine (``python -m kvserve.engine.spec_decode.ngram``; see
docs/serving/speculative.md): building over a prompt is linear in its length, a lookup and a
one-token update are constant; memory is about 100 bytes per (token, n) pair.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._followers: list[dict[int, int]] = [{} for _ in range(max_n - min_n + 1)]
        self._indexed = 0  # tokens[:_indexed] have had their n-grams (ending before them) entered

    def extend(self, tokens: list[int]) -> None:
        """Enter the n-grams that gained a follower since the last call (``tokens`` only grows)."""
        end = len(tokens)
        for n, table in zip(range(self.min_n, self.max_n + 1), self._followers, strict=True):
            first = max(self._indexed, n)  # the first follower not entered yet for this n
            if first < end:  # the n-grams tokens[f - n : f] for f in [first, end), built in C
                grams = zip(*(tokens[first - n + i : end - n + i] for i in range(n)), strict=True)
                table.update(zip(map(hash, grams), range(first, end), strict=True))  # later occurrences win
        self._indexed = end

    def propose(self, tokens: list[int], k: int, after: list[int] | None = None) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens for what follows ``tokens``, and the n-gram length that matched
        (0 and no drafts when no suffix of min_n..max_n tokens occurred before).

        ``after``: tokens not committed yet (a grammar's forced tokens) that come after ``tokens``:
        the suffix matched ends with them and the copy runs on through them, but only ``tokens``
        enter the index."""
        self.extend(tokens)
        context = tokens[-self.max_n :] + after if after else tokens
        end = len(tokens) + len(after or ())
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            follower = self._followers[n - self.min_n].get(hash(tuple(context[len(context) - n :])))
            if follower is not None:
                drafts = tokens[follower : follower + k]
                if after and len(drafts) < k:
                    drafts += after[: k - len(drafts)]
                period = end - follower  # where the copy runs into its own drafts
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return drafts, n
        return [], 0


def _measure() -> None:
    """Print the build, update and lookup cost (CPU time of this process) at 1k, 8k and 32k tokens of
    context."""
    import random
    import sys
    import time
    import tracemalloc

    rng = random.Random(0)
    for size in (1024, 8192, 32768):
        tokens = [rng.randrange(2000) for _ in range(size)]
        t0 = time.process_time()
        NgramIndex(2, 5).extend(tokens)
        build = time.process_time() - t0
        tracemalloc.start()  # (slows allocation: the build is timed without it)
        index = NgramIndex(2, 5)
        index.extend(tokens)
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        t0 = time.process_time()
        for _ in range(1000):
            tokens.append(rng.randrange(2000))
            index.propose(tokens, 5)
        step = (time.process_time() - t0) / 1000
        sys.stdout.write(f"context {size:6d}: build {build * 1e3:7.1f} ms, "
                         f"update + lookup {step * 1e6:6.1f} us, index {memory / 2**20:6.1f} MiB\n")


if __name__ == "__main__":
    _measure()
