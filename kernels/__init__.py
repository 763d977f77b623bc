"""kvserve.kernels: Triton kernels for the paged KV cache (needs the ``triton`` package).

On a machine without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1`` set
before this package is first imported), which is how the tests check them on the CPU.
"""

from kvserve.kernels.kv_store import store_kv_cache
from kvserve.kernels.paged_attention import (
    DecodeWorkspace,
    decode_num_splits,
    device_sm_count,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tile_shape,
    prefill_work,
)

__all__ = [
    "DecodeWorkspace",
    "decode_num_splits",
    "device_sm_count",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_tile_shape",
    "prefill_work",
    "store_kv_cache",
]
