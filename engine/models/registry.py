"""Which class serves which Hugging Face architecture. Each model module registers its classes
with ``@register_model``; the loader asks ``model_class_for``. This module imports no model, so
neither the loader nor a model imports the other.
"""

from __future__ import annotations

from torch import nn

MODEL_REGISTRY: dict[str, type[nn.Module]] = {}  # Hugging Face architecture name -> class
SUPPORTED_ARCHITECTURES: list[str] = []  # in registration order (the models package imports them)


def register_model(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: the class serves the Hugging Face architecture of its own name
    (``config.architectures``), e.g. ``LlamaForCausalLM``."""
    if cls.__name__ in MODEL_REGISTRY:
        raise ValueError(f"architecture {cls.__name__} is registered twice")
    MODEL_REGISTRY[cls.__name__] = cls
    SUPPORTED_ARCHITECTURES.append(cls.__name__)
    return cls


def model_class_for(hf_config) -> type[nn.Module]:
    """The registered class of the config's architecture; refuses what we cannot run: the window
    check below, then the class's own ``refuse_unsupported(hf_config)`` where it has one (a
    ValueError naming the architecture and the feature)."""
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            cls = MODEL_REGISTRY[name]
            _refuse_unsupported_features(hf_config, name)
            if hasattr(cls, "refuse_unsupported"):
                cls.refuse_unsupported(hf_config)
            return cls
    raise ValueError(
        f"model architecture {architectures or 'unknown'} is not supported; "
        f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
    )


def _refuse_unsupported_features(hf_config, name: str) -> None:
    if getattr(MODEL_REGISTRY[name], "supports_sliding_window", False):
        return  # its layers pass their windows to the attention backend (``create_impl``)
    if "sliding_attention" in (getattr(hf_config, "layer_types", None) or []):
        raise ValueError(f"{name} with sliding-window attention layers is not supported")
    window = getattr(hf_config, "sliding_window", None)  # Mixtral; Qwen's count only when switched on
    used = getattr(hf_config, "use_sliding_window", True)
    if used and window and window < hf_config.max_position_embeddings:
        raise ValueError(f"{name} with sliding_window={window} (below max_position_embeddings="
                         f"{hf_config.max_position_embeddings}) is not supported: attention here is global")
