"""The CPU decode-attention kernel (``csrc/paged_decode.c``): built once per machine, called by ctypes.

Why C: on the CPU, decode attention in torch ops gathers every sequence's K/V blocks into a
padded copy, multiplies in many small batched matmuls and allocates several MiB per layer; a
loop that reads each key and value once, in place, costs what reading the cache costs. The
kernel is small plain C (no torch headers), so building it takes about a second.

Build: the system C compiler (``$CC`` or ``cc``) with ``-O3 -march=native -fopenmp``; the
shared object is cached under ``$KVSERVE_CACHE_DIR/kernels`` (default ``~/.cache/kvserve``),
named by a hash of the source, the flags, the compiler's version and this CPU's feature flags,
so a cache shared between machines never hands one CPU another's instructions. It links
``libgomp.so.1``, the OpenMP runtime torch has already loaded, so both share one thread pool.

``load_kernel()`` returns None — and the torch backend keeps its torch-ops path — when there is
no compiler, the build fails (the log says why, once), or ``KVSERVE_CPU_KERNELS=0`` asks for the
torch-ops path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvserve.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "KVSERVE_CPU_KERNELS"
MAX_HEAD_DIM = 512  # as in the C source
MAX_GROUP = 64

_ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_P, _I64, _I64, _P, _P, _I64, _I32, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _F32,
             _P, _I64, _I64, _I32]


def cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0] if out.stdout else ""


def build(cc: str) -> Path:
    """The cached shared object for this source, compiler and CPU (compiled when missing)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


class PagedDecodeKernel:
    """The loaded library: ``run`` computes decode attention for the given sequences."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fns = {}
        for dtype, name in _ENTRY_POINTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    @staticmethod
    def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (dtype in _ENTRY_POINTS and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= MAX_GROUP)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, seq_ids: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
            scale: float) -> None:
        """For each i: ``out[tokens[i]]`` = attention of ``q[tokens[i]]`` [heads, D] over the first
        ``seq_lens[seq_ids[i]]`` keys/values of the blocks in ``block_tables[seq_ids[i]]``.

        q, out: [T, heads, D] with D contiguous; caches [kv_heads, blocks, block_size, D] contiguous;
        block_tables int32 [S, W] with rows contiguous; seq_lens, seq_ids, tokens int32, contiguous.
        """
        kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        num_heads = q.shape[1]
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
                and out.stride(2) == 1 and out.dtype == q.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError("paged decode kernel: caches must be contiguous, q/out rows contiguous, "
                             "one dtype throughout")
        block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        seq_lens, seq_ids, tokens = (t.contiguous() for t in (seq_lens, seq_ids, tokens))
        status = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
            block_size, block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            seq_ids.data_ptr(), tokens.data_ptr(), seq_ids.numel(), num_heads, kv_heads, head_dim, scale,
            out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged decode kernel failed with status {status} (2: out of memory)")


@functools.cache
def load_kernel() -> PagedDecodeKernel | None:
    """The kernel, built if needed; None when disabled or unbuildable (logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("%s=0: CPU decode attention runs as torch ops", ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, or $CC) found: CPU decode attention runs as torch ops (slower)")
        return None
    try:
        return PagedDecodeKernel(build(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("building the CPU decode-attention kernel failed, using torch ops instead: %s", exc)
        return None
