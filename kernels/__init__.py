"""kvserve.kernels: the kernels by target. ``triton/`` holds the GPU kernels (paged attention, the
KV-cache store, fused MoE; they need the ``triton`` package), ``cpu/`` the C kernels, their build
and their ctypes bindings (no Triton). Nothing here imports ``kvserve.engine``.

The Triton names below are imported on first use (PEP 562), so a process that runs only the CPU
kernels never imports Triton. On a machine without a GPU the Triton kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before they are first imported), which is how the tests
check them on the CPU.
"""

import importlib

_LAZY = {
    "store_kv_cache": "triton.kv_store",
    "DecodeWorkspace": "triton.decode_splits",
    "decode_num_splits": "triton.decode_splits",
    "device_sm_count": "triton.decode_splits",
    "paged_decode_attention": "triton.paged_attention",
    "paged_prefill_attention": "triton.paged_attention",
    "prefill_tile_shape": "triton.paged_attention",
    "prefill_work": "triton.paged_attention",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
