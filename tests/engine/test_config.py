"""Engine configuration rules that need no model: the token budget a step gets by device."""

from __future__ import annotations

import pytest

from kvserve.engine.config import EngineConfig, resolve_max_num_batched_tokens


def test_an_unset_token_budget_is_2048():
    assert EngineConfig().max_num_batched_tokens is None
    assert resolve_max_num_batched_tokens(EngineConfig()) == 2048


def test_a_given_token_budget_is_kept():
    assert resolve_max_num_batched_tokens(EngineConfig(max_num_batched_tokens=4096)) == 4096
    assert resolve_max_num_batched_tokens(EngineConfig(max_num_batched_tokens=256)) == 256


def test_the_default_budget_never_starves_running_sequences():
    """Every running sequence needs a token of budget per step, so the default grows with max_num_seqs."""
    assert resolve_max_num_batched_tokens(EngineConfig(max_num_seqs=4096)) == 4096


def test_a_given_budget_below_max_num_seqs_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens must be >= 1, got 0"):
        EngineConfig(max_num_batched_tokens=0)
