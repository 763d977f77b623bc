"""glibc malloc settings for a CPU engine: activations reuse heap memory instead of fresh pages.

PyTorch's CPU allocator asks malloc for every tensor. glibc serves a request above its mmap
threshold (128 KiB at start, raised dynamically only up to the largest block freed so far)
with a fresh ``mmap`` and returns it to the OS on free; with the default 128 KiB trim
threshold it also gives the top of the heap back after most frees. A forward pass allocates
and frees the same few-MiB activations every layer, so each of them came back as new pages:
one page fault per 4 KiB and the kernel zeroing it, on every layer of every step. Measured on
a 2-core VM, a decode attention layer at batch 48 took 3x longer for that alone.

``tune_malloc`` fixes the thresholds once per process (glibc reads ``MALLOC_*_`` environment
variables only at start, ``mallopt`` works at any time): blocks up to ``MMAP_THRESHOLD`` come
from the heap, and the heap is trimmed only when ``TRIM_THRESHOLD`` bytes are free at its top.
The heap then stays near the peak working set of one step instead of shrinking after each
layer; memory held by freed activations is reused by the next step, not lost.

The front-end is the opposite case: it does no tensor work, and the only large blocks it sees
are request messages (up to the 16 MiB receive limit) and what parsing them allocates. With
glibc's dynamic threshold, one 16 MB message freed raises the threshold past the next one's
buffers, which then come from a heap or a thread's arena and stay there: five refused 15.9 M-id
requests grew the front-end by 4-113 MiB, run to run. ``return_large_blocks`` fixes the
threshold at ``FRONTEND_MMAP_THRESHOLD`` so every such block is mapped and unmapped on free.

Not glibc (musl, macOS): nothing to tune, both return False.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
FRONTEND_MMAP_THRESHOLD = 1 << 20  # above per-request allocations, far below a big message


def _mallopt():
    try:  # the symbols already loaded into this process (libc among them): no ldconfig lookup
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


@functools.cache
def tune_malloc() -> bool:
    """Apply the engine's thresholds above to this process's glibc malloc; True when applied."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


@functools.cache
def return_large_blocks() -> bool:
    """The front-end's setting: blocks of ``FRONTEND_MMAP_THRESHOLD`` or more are mapped on their
    own and go back to the OS when freed; True when applied."""
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, FRONTEND_MMAP_THRESHOLD))
