"""Rotary scaling from the config's rope settings agrees with transformers' own tables."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.engine.layers.rotary import inverse_frequencies, rope_parameters

LLAMA31 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, LLAMA31])
def test_scaled_inverse_frequencies_match_transformers(rope):
    """(Unscaled rope is pinned by the greedy-parity tests against transformers.)"""
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=dict(rope)
    )
    theirs, attention_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert attention_scale == 1.0
    ours = inverse_frequencies(64, rope_parameters(config))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def test_unknown_rope_type_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="'dynamic' is not supported.*llama3.*yarn"):
        inverse_frequencies(64, {"rope_type": "dynamic", "rope_theta": 1e4})


@pytest.mark.parametrize("overrides", [{}, {"truncate": True}, {"attention_factor": 1.2}])
def test_yarn_frequencies_and_attention_factor_are_transformers(overrides):
    """gpt-oss's YaRN (and the variants of its settings) against transformers' own computation."""
    from transformers import GptOssConfig

    from kvserve.engine.layers.rotary import attention_factor

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096, **overrides}
    config = GptOssConfig(head_dim=64, num_attention_heads=8, hidden_size=512, rope_parameters=params)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = rope_parameters(config)
    torch.testing.assert_close(inverse_frequencies(64, ours), want, rtol=1e-6, atol=0)
    assert attention_factor(ours) == pytest.approx(want_factor)


def test_longrope_turns_the_original_context_by_the_short_factors_and_later_positions_by_the_long():
    """Phi-4-mini's LongRoPE against transformers' own frequencies: its short ones (a sequence within
    the original context) up to it, its long ones (a longer sequence) after; the same cos/sin scale."""
    from kvserve.engine.layers.rotary import RotaryEmbedding, attention_factor
    from kvserve.testing.random_model import make_config

    config = make_config("phi4-mini-tiny")
    params, old_len, dim = rope_parameters(config), 64, 12  # 3/4 of a 16-wide head
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=old_len + 1)
    assert attention_factor(params) == pytest.approx(scale) and scale > 1
    table = RotaryEmbedding(dim, 256, params).cos_table[:, : dim // 2]  # cos(position * inv_freq) * scale
    positions = torch.arange(256, dtype=torch.float32)[:, None]
    want = torch.cat([(positions[:old_len] * short).cos(), (positions[old_len:] * long).cos()]) * scale
    torch.testing.assert_close(table, want, rtol=1e-5, atol=1e-5)
