"""The sampler: turns each sequence's last-position logits into its next token.

Owns the per-request sampling policy (``SamplingParams``, proto/kvserve/v1/llm.proto): penalties, the
min_tokens mask, greedy argmax, temperature, min_p / top_k / top_p truncation, the random
draw and the raw-distribution logprobs.

Rows of one batch carry different parameters; the per-row values travel as small device
tensors, so each stage runs once over the rows that need it. The only host sync is the
read-back of the results at the end.

The random draw is by inverse CDF: one uniform per row, looked up in the row's cumulative
(unnormalised) probabilities with a binary search, so a draw costs one number per row, not one
per vocabulary entry; greedy rows draw nothing. The uniforms are made on the host: a seeded
row's is a hash of (seed, absolute position of the token drawn), so its output does not depend on
batch composition, survives a recompute after preemption, and is the same whether the position is
sampled by a plain decode step or as a speculative draft's verification row (n > 1: choice i's seed
is seed + i); unseeded rows take theirs from one
generator seeded by the engine's ``seed``.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import torch

from kvserve.engine.layers.sampling_batch import SamplingBatch
from kvserve.engine.outputs import TokenLogprobs
from kvserve.kernels.cpu.bindings import kernels_for

_MASK64 = (1 << 64) - 1
# on CPU, top_p first looks for its cutoff among this many largest logits (a full sort is slow)
_CPU_SORT_PREFIX = 256


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request asked for no logprobs


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._rng = random.Random(seed)  # the uniforms of unseeded rows

    def __call__(self, logits: torch.Tensor, seqs: list,
                 drafts: list[list[int]] | None = None) -> SamplerOutput:
        """``sample`` over ``prepare(seqs, drafts)``."""
        return self.sample(logits, self.prepare(seqs, drafts))

    def prepare(self, seqs: list, drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The step's batch: row i samples ``seqs[i]`` after ``drafts[i]`` (``SamplingBatch.of``)."""
        return SamplingBatch.of(seqs, self.eos_token_ids, self.vocab_size, drafts)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"logits must be [num_seqs={len(batch)}, vocab], got {tuple(logits.shape)}")
        raw = logits[:, : self.vocab_size].float()
        token_ids = self._choose(_edit_logits(raw, batch), batch)
        logprob_rows = [i for i, n in enumerate(batch.num_logprobs) if n > 0]
        pending = _logprob_tensors(raw, token_ids, batch, logprob_rows) if logprob_rows else None
        ids = token_ids.tolist()  # the one host sync
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        if pending is not None:
            entries = _read_logprobs(pending, ids, batch, logprob_rows)
            for row, entry in zip(logprob_rows, entries, strict=True):
                logprobs[row] = entry
        return SamplerOutput(ids, logprobs)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[n] token ids: argmax for greedy rows, a random draw for the others."""
        random_rows = [i for i, greedy in enumerate(batch.greedy) if not greedy]
        if not random_rows:
            return _argmax(logits)  # the common all-greedy batch: no sort, no noise
        if len(random_rows) == len(batch):
            return self._sample_random(logits, batch, random_rows)
        rows = _to_device(random_rows, torch.long, logits.device)
        sampled = self._sample_random(logits.index_select(0, rows), batch, random_rows)
        return _argmax(logits).index_copy(0, rows, sampled)

    # -- random rows ----------------------------------------------------------------------

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then one inverse-CDF draw per row (``logits``: the
        batch's ``rows``, in that order)."""
        device = logits.device
        temps = _to_device([batch.temperatures[i] for i in rows], torch.float32, device)
        logits = logits / temps.unsqueeze(1)
        min_ps = [batch.min_ps[i] for i in rows]
        if any(m > 0 for m in min_ps):
            logits = _apply_min_p(logits, _to_device(min_ps, torch.float32, device))
        top_ks, top_ps = [batch.top_ks[i] for i in rows], [batch.top_ps[i] for i in rows]
        logits = _apply_top_k_top_p_rows(logits, top_ks, top_ps)
        return _inverse_cdf_draw(logits, _to_device(self._uniforms(batch, rows), torch.float32, device))

    def _uniforms(self, batch: SamplingBatch, rows: list[int]) -> list[float]:
        """One U[0, 1) per row: a seeded row's from (seed, position), the others' from the engine's."""
        draws = []
        for i in rows:
            seed = batch.seeds[i]
            draws.append(self._rng.random() if seed is None else _row_uniform(seed, batch.positions[i]))
        return draws


# -- logit edits shared by greedy and random rows -----------------------------------------


def _edit_logits(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties and the min_tokens mask, on a copy; ``raw`` itself when nothing applies."""
    penalty_rows = [i for i in range(len(batch)) if batch.has_penalty(i)]
    mask_rows = [i for i, ids in enumerate(batch.forbidden) for _ in ids]
    if not penalty_rows and not mask_rows:
        return raw
    logits = raw.clone(memory_format=torch.contiguous_format)  # penalties index it flat
    if penalty_rows:
        _apply_penalties(logits, batch, penalty_rows)
    if mask_rows:
        rows = _to_device(mask_rows, torch.long, logits.device)
        cols = _to_device([t for ids in batch.forbidden for t in ids], torch.long, logits.device)
        logits[rows, cols] = float("-inf")  # a Python scalar: no host-to-device copy
    return logits


def _row_kernels(logits: torch.Tensor):
    """The CPU kernels when they take these logits (2-D float32 on the CPU), else None."""
    return kernels_for(logits) if logits.dim() == 2 and logits.dtype == torch.float32 else None


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit; on the CPU by the vectorized kernel (kernels/cpu/bindings.py)."""
    if (kernels := _row_kernels(logits)) is not None:
        return kernels.argmax(logits)
    return logits.argmax(dim=-1)


def _inverse_cdf_draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose cumulative-probability interval holds ``uniform * total``.

    ``logits`` is the function's own tensor (it is overwritten). exp(-inf) = 0 gives masked
    tokens an empty interval, which the search (first cumulative value above the target) never
    lands in; the target is kept below the total, where float32 rounding of ``u * total`` could
    otherwise reach it. On the CPU the kernel does the same in one pass and a walk (float64 sums)."""
    if (kernels := _row_kernels(logits)) is not None:  # uniforms are on the logits' device: the CPU
        return kernels.inverse_cdf_draw(logits, uniforms)
    cdf = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


# -- penalties ------------------------------------------------------------------------------


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """In place on a contiguous ``logits``, touching only the tokens each row has seen."""
    rep_rows = [i for i in rows if batch.repetition_penalties[i] != 1.0]
    if rep_rows:
        _apply_repetition_penalty(logits, batch, rep_rows)
    out_rows = [i for i in rows if batch.presence_penalties[i] or batch.frequency_penalties[i]]
    if out_rows:
        _apply_presence_frequency(logits, batch, out_rows)


def _apply_repetition_penalty(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """HF/vLLM: over prompt and output tokens, positive logits are divided by the penalty,
    negative ones multiplied."""
    vocab = logits.shape[1]
    seen = [_in_vocab(set(batch.seen_tokens[i]), vocab) for i in rows]
    keys, lengths = _flat_keys(rows, seen, vocab)
    penalty = _per_key([batch.repetition_penalties[i] for i in rows], lengths)
    keys = _to_device(keys, torch.long, logits.device)
    penalty = _to_device(penalty, torch.float32, logits.device)
    flat = logits.view(-1)
    values = flat[keys]
    flat[keys] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_presence_frequency(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
    """OpenAI: over output tokens, minus presence once and frequency per occurrence."""
    vocab = logits.shape[1]
    counts = [_count_in_vocab(batch.output_tokens[i], vocab) for i in rows]
    keys, lengths = _flat_keys(rows, [c.keys() for c in counts], vocab)
    occurrences = torch.tensor(list(itertools.chain.from_iterable(c.values() for c in counts)))
    freq = _per_key([batch.frequency_penalties[i] for i in rows], lengths)
    pres = _per_key([batch.presence_penalties[i] for i in rows], lengths)
    keys = _to_device(keys, torch.long, logits.device)
    delta = _to_device(freq * occurrences + pres, torch.float32, logits.device)
    logits.view(-1)[keys] -= delta


# the two guards below keep the flat index (row * vocab + token) inside its row


def _in_vocab(tokens: set[int], vocab: int) -> set[int]:
    return {t for t in tokens if t < vocab} if tokens and max(tokens) >= vocab else tokens


def _count_in_vocab(tokens: list[int], vocab: int) -> Counter[int]:
    counts = Counter(tokens)
    if counts and max(counts) >= vocab:
        counts = Counter({t: n for t, n in counts.items() if t < vocab})
    return counts


def _flat_keys(
    rows: list[int], token_groups: list[Iterable[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors: row * vocab + token for every token of every row's group, and the group sizes."""
    lengths = torch.tensor([len(g) for g in token_groups], dtype=torch.long)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_groups)), dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    return row_ids * vocab + tokens, lengths


def _per_key(per_row: list[float], lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(per_row, dtype=torch.float32), lengths)


# -- truncation -----------------------------------------------------------------------------


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _apply_top_k_top_p_rows(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """top_k and top_p (one of each per row of ``logits``), on the rows that ask for either."""
    vocab = logits.shape[1]
    rows = [i for i, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)) if k > 0 or p < 1.0]
    if not rows:
        return logits
    ks = [min(top_ks[i], vocab) or vocab for i in rows]  # vocab = no limit
    ps = [top_ps[i] for i in rows]
    if len(rows) == len(top_ks):
        return _apply_top_k_top_p(logits, ks, ps)
    rows_t = _to_device(rows, torch.long, logits.device)
    kept = _apply_top_k_top_p(logits.index_select(0, rows_t), ks, ps)
    return logits.index_copy(0, rows_t, kept)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Keep each row's k largest logits, then the smallest most-likely prefix whose mass
    (renormalised after top_k) reaches top_p; the most likely token always stays, and so
    do ties at the cutoff."""
    device, vocab = logits.device, logits.shape[1]
    k = _to_device(top_ks, torch.long, device)
    p = _to_device(top_ps, torch.float32, device).unsqueeze(1)
    width = _sort_width(device, top_ks, vocab)
    cutoff, placed = _cutoff_among_largest(logits, width, k, p)
    if max(top_ks) > width:  # rows without top_k that looked at a prefix: CPU only, no device sync
        missing = (~placed).nonzero().squeeze(1)
        if missing.numel():
            full, _ = _cutoff_among_largest(logits.index_select(0, missing), vocab, k[missing], p[missing])
            cutoff = cutoff.index_copy(0, missing, full)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _sort_width(device: torch.device, top_ks: list[int], vocab: int) -> int:
    """How many of each row's largest logits the cutoff search sorts: the largest top_k when
    every row has one; otherwise the whole row on GPU (no host sync), and on CPU, where a
    full sort is slow, a short prefix whose rows are re-done in full when it falls short."""
    if max(top_ks) < vocab:
        return max(top_ks)
    if device.type != "cpu":
        return vocab
    return min(vocab, max([_CPU_SORT_PREFIX] + [k for k in top_ks if k < vocab]))


def _cutoff_among_largest(
    logits: torch.Tensor, width: int, k: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest logit kept by top_k then top_p, found among the ``width`` largest
    logits ([rows, 1]); and whether those were enough to place it ([rows] bool)."""
    vocab = logits.shape[1]
    ordered = (
        logits.topk(width, dim=-1).values if width < vocab else logits.sort(dim=-1, descending=True).values
    )
    ordered = ordered.masked_fill(torch.arange(width, device=logits.device) >= k.unsqueeze(1), float("-inf"))
    norm = ordered.logsumexp(dim=-1, keepdim=True)
    if width < vocab:  # a row without top_k normalises over its whole row, not the prefix
        norm = torch.where(k.unsqueeze(1) <= width, norm, logits.logsumexp(dim=-1, keepdim=True))
    probs = (ordered - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 keeps everything even where float rounding lets the cumulative mass hit 1 early
    keep = ((mass_before < p) | (p >= 1.0)) & (ordered > float("-inf"))
    num_kept = keep.sum(dim=-1, keepdim=True)
    cutoff = ordered.gather(1, num_kept.clamp_min(1) - 1)
    placed = (k <= width) | (num_kept.squeeze(1) < width)
    return cutoff, placed


# -- logprobs -------------------------------------------------------------------------------


class _LogprobTensors(NamedTuple):
    chosen: torch.Tensor  # [m] logprob of the sampled token
    top_values: torch.Tensor  # [m, max N]
    top_ids: torch.Tensor  # [m, max N]


def _logprob_tensors(
    raw: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch, rows: list[int]
) -> _LogprobTensors:
    """Log-softmax of the raw model logits (before penalties and temperature)."""
    rows_t = _to_device(rows, torch.long, raw.device)
    logprobs = raw.index_select(0, rows_t).log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.index_select(0, rows_t).unsqueeze(1)).squeeze(1)
    top = logprobs.topk(max(batch.num_logprobs[i] for i in rows), dim=-1)
    return _LogprobTensors(chosen, top.values, top.indices)


def _read_logprobs(
    t: _LogprobTensors, ids: list[int], batch: SamplingBatch, rows: list[int]
) -> list[TokenLogprobs]:
    chosen, values, top_ids = t.chosen.tolist(), t.top_values.tolist(), t.top_ids.tolist()
    out = []
    for j, row in enumerate(rows):
        n = batch.num_logprobs[row]
        top = list(zip(top_ids[j][:n], values[j][:n], strict=True))
        out.append(TokenLogprobs(token_id=ids[row], logprob=chosen[j], top=top))
    return out


# -- helpers --------------------------------------------------------------------------------


def _to_device(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a device tensor without a blocking copy (pinned on CUDA)."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _row_uniform(seed: int, position: int) -> float:
    """A U[0, 1) draw that depends on (request seed, absolute position of the drawn token) alone."""
    mixed = _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)
    return (mixed >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
