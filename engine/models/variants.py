"""Which attention variant each decoder layer of a Hugging Face config asks for, read the way
transformers 5.24 reads it, so that every family passes the same keywords to ``create_impl``."""

from __future__ import annotations


def layer_window(config, layer_idx: int) -> int | None:
    """The layer's sliding window in tokens (``config.sliding_window`` on a layer that
    ``layer_types`` marks ``sliding_attention``), or None for full attention. Configs with a
    ``use_sliding_window`` switch (SmolLM3, Qwen) window nothing while it is off."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None) or []
    if layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention":
        return config.sliding_window
    return None
