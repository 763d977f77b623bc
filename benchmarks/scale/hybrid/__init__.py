"""The linear-attention hybrids' parts in process (``python -m kvserve.benchmarks.scale.hybrid.NAME``):
``gated_delta`` (one layer's rule, C against the torch forms), ``prefill`` (chunk sizes, the gated
norm A/B), ``decode`` (the one-row step's parts, fused against per op), ``verify`` (speculative
verification's per-position states). docs/performance/hybrids.md has their figures."""
