"""Rotary position embeddings (the "neox" rotate-half form Hugging Face uses for Llama and Qwen).

The cos/sin tables are computed once in float32 for every position up to the model's maximum;
a forward pass looks up its positions once (``RotaryEmbedding.cos_sin``) and every layer
rotates its q and k with the same pair (``apply_rotary``: three elementwise ops).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.kernels.cpu.abi import MAX_HEAD_DIM
from kvserve.kernels.cpu.bindings import kernels_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config) -> dict:
    """The config's rope settings as one dict with ``rope_theta`` and ``rope_type``.

    transformers 5 keeps them in ``rope_parameters``; 4.x in ``rope_theta`` + ``rope_scaling``.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "longrope":  # its attention factor follows the context's growth
        old_len = params.setdefault("original_max_position_embeddings",
                                    hf_config.original_max_position_embeddings)
        params.setdefault("factor", hf_config.max_position_embeddings / old_len)
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    """The float32 inverse frequencies of one head, with the configured scaling applied."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "yarn":
        return _yarn_scaled(inv_freq, head_dim, params)
    if rope_type == "longrope":  # the short factors; positions past the original context: ``_long_rope``
        return inv_freq / torch.tensor(params["short_factor"], dtype=torch.float32)
    return inv_freq


def _long_rope(head_dim: int, params: dict) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    long_factor = torch.tensor(params["long_factor"], dtype=torch.float32)
    return 1.0 / (params["rope_theta"] ** exponents) / long_factor


def attention_factor(params: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for the other types): ``attention_factor`` when the
    config gives it, else 0.1 ln(factor) + 1 (the ratio of two such terms with ``mscale`` and
    ``mscale_all_dim``)."""
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = params["factor"]
    if params["rope_type"] == "longrope":  # sqrt(1 + ln(factor) / ln(original context))
        old_len = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(params["mscale"]) / mscale(params["mscale_all_dim"])
    return mscale(1.0)


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, params: dict) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn fewer than ``beta_slow`` times over the original
    context are divided by ``factor``, those turning more than ``beta_fast`` times are kept, with a
    linear ramp over the dimensions between (``truncate``: the ramp's ends rounded outwards)."""
    base, factor = params["rope_theta"], params["factor"]
    old_len = params["original_max_position_embeddings"]
    dim_of = lambda turns: head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_scaled(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a blend between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.to(torch.float32))
        if params["rope_type"] == "longrope":
            # LongRoPE (Phi-3.5, Phi-4-mini): positions past the original context turn with the long
            # factors, each position by its own (transformers switches a whole sequence to them
            # once it outgrows that context, the K it cached before included; within it the two agree)
            old_len = params["original_max_position_embeddings"]
            later = torch.arange(old_len, max(old_len, max_position), dtype=torch.float32)
            freqs[old_len:] = torch.outer(later, _long_rope(head_dim, params))
        self.max_position = max_position
        # full width: cos repeated over both halves, sin with the rotation's sign (-sin, sin)
        scale = attention_factor(params)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos_table", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_table", torch.cat((-sin, sin), dim=-1), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair ``apply_rotary`` takes for ``positions``: [tokens, 1, head_dim] each, in ``dtype``."""
        cos = self.cos_table.index_select(0, positions).to(dtype)
        sin = self.sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim], whose two halves form the complex pairs:
    ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``, with ``cos``/``sin`` from ``cos_sin``.

    On the CPU the kernel rotates ``x`` in place and returns it: pass a tensor you own (the
    models pass their fresh q|k projection)."""
    if x.shape[-1] <= MAX_HEAD_DIM and (kernels := kernels_for(x, cos, sin)) is not None:
        return kernels.rotary_(x, cos, sin)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
