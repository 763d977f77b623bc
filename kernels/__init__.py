"""kvserve.kernels: Triton kernels for the paged KV cache (needs the ``triton`` package), and the
CPU kernels in C (``cpu_kernels``, ``cpu_build``; no Triton).

The Triton names below are imported on first use (PEP 562), so a process that runs only the CPU
kernels never imports Triton. On a machine without a GPU the Triton kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before they are first imported), which is how the tests
check them on the CPU.
"""

import importlib

_LAZY = {
    "store_kv_cache": "kv_store",
    "DecodeWorkspace": "paged_attention",
    "decode_num_splits": "paged_attention",
    "device_sm_count": "paged_attention",
    "paged_decode_attention": "paged_attention",
    "paged_prefill_attention": "paged_attention",
    "prefill_tile_shape": "paged_attention",
    "prefill_work": "paged_attention",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
