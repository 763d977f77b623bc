"""kvserve.kernels: Triton kernels for the paged KV cache (needs the ``triton`` package).

On a machine without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1`` set
before this package is first imported), which is how the tests check them on the CPU.
"""

from kvserve.kernels.kv_store import store_kv_cache
from kvserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv_cache"]
