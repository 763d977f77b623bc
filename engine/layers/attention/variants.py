"""The softmax variants of attention in torch ops, for the CPU backend's torch path (and as the
reference the kernels are tested against): the logit soft cap (Gemma 2) and attention sinks
(gpt-oss). The sliding window is a mask, which the callers build.

- soft cap ``c``: each score s (already scaled) becomes ``c * tanh(s / c)`` before the mask, as
  transformers' eager attention does;
- sinks: one learned logit per query head joins the softmax's denominator and weighs no value:
  ``p_i = exp(s_i) / (sum_j exp(s_j) + exp(sink))``. The softmax runs in float32 either way.
"""

from __future__ import annotations

import torch


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``; ``scores`` unchanged when ``cap`` is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 probabilities over the last dimension of ``scores``; ``sinks`` (broadcastable to
    ``scores`` with a last dimension of 1) join the denominator only."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    scores = scores.float()
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def eager_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of one sequence's queries ``q`` [heads, Tq, D] over ``keys``/``values``
    [kv_heads, Tk, D] with the variants; ``mask`` bool [Tq, Tk] (True: attend), None: causal over
    the last Tq keys. ``sinks`` [heads]. Returns [heads, Tq, D] in ``q``'s dtype."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    group = heads // kv_heads
    rows = q.reshape(kv_heads, group * q.shape[1], q.shape[2])  # the query heads sharing a KV head
    scores = torch.bmm(rows * scale, keys.transpose(1, 2)).view(heads, q.shape[1], keys.shape[1])
    scores = soft_cap(scores, cap)
    if mask is None:
        t_q, t_k = q.shape[1], keys.shape[1]
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(t_k - t_q)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(heads, 1, 1)).to(q.dtype)
    out = torch.bmm(probs.view(kv_heads, group * q.shape[1], -1), values)
    return out.view(heads, q.shape[1], q.shape[2])
