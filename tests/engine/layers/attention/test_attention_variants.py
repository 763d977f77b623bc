"""The attention variants a layer asks for at ``create_impl``: kept on the impl, or refused there
with the variant's and the backend's names."""

import pytest

from kvserve.engine.layers.attention.cpu_backend import CpuAttentionBackend


def test_plain_impl_has_no_variant():
    impl = CpuAttentionBackend(block_size=4).create_impl(4, 2, 8, 0.25)
    assert (impl.sliding_window, impl.logits_soft_cap, impl.has_sinks) == (None, None, False)


@pytest.mark.parametrize("variant", [{"logits_soft_cap": 50.0}, {"sinks": True}])
def test_unimplemented_variant_is_refused_by_name(variant):
    with pytest.raises(ValueError, match=f"{next(iter(variant))} is not implemented by the torch"):
        CpuAttentionBackend(block_size=4).create_impl(4, 2, 8, 0.25, **variant)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        CpuAttentionBackend(block_size=4).create_impl(4, 2, 8, 0.25, sliding_window=window)
