"""The CPU kernels (``csrc/*.c``): built once per machine, called through ctypes.

- ``paged_decode`` (csrc/attention.c): attention over the torch backend's head-major paged cache,
  one query row at a time. In torch ops a decode gathers every sequence's K/V blocks into a padded
  copy, multiplies in many small batched matmuls and allocates several MiB per layer; the kernel
  reads each key and value once, in place. Prefill tokens go through it too, each over the keys
  up to its own position (``ctx_lens``), with AVX-512: ~1.8x torch's CPU flash SDPA at prompts of
  a few hundred tokens, as fast at 2-4k; AVX2 only: faster to ~1k (``kernel_prefill_context``).
- ``gemm`` (csrc/gemm.c): bfloat16 projections of any number of rows over a copy of the weight
  packed once (``pack_gemm_weight``; AVX-512, or AVX2 with FMA); faster than oneDNN's at 8 to
  128 rows, as fast beyond; ``quantized_gemm``: int8/int4 weights, dequantized a panel at a time.
- ``rms_norm`` (with the residual add), ``silu_and_mul``, ``rotary_`` and ``store_kv``
  (csrc/elementwise.c): one pass each where eager torch runs several ops, each with its own
  allocation and thread-pool wake-up.
- ``argmax`` (csrc/sampling.c): the greedy pick (torch's CPU argmax is not vectorized: 2.2 ms for
  256 rows of 10,240 logits); ``inverse_cdf_draw``: the random pick, one pass for the maximum and
  one for exp and chunk sums, then a walk inside one chunk (torch: amax, exp, cumsum, searchsorted).

Why C: small plain C (no torch headers), so a build takes a second or two, with the compiler
every Linux image has (the build and its cache: build.py). It links ``libgomp.so.1``, the
OpenMP runtime torch has already loaded, so both share one thread pool.

``load_kernels()`` returns None, and every caller keeps its torch-ops path, when there is no
compiler, the build fails (the log says why, once), or ``KVSERVE_CPU_KERNELS=0`` asks for the
torch-ops path. ``kernels_for(tensor)`` also returns None for tensors the kernels do not take
(not on the CPU, not float32/bfloat16).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path

import torch

from kvserve.kernels.cpu.abi import (
    DTYPES,
    MAX_FUSED_ROWS,
    MAX_GROUP,
    MAX_HEAD_DIM,
    SIGNATURES,
    W_INT4,
    W_INT8,
    Linear,
    PackedWeight,
    RowStep,
    cache_code,
    check_caches,
    takes_caches,
)
from kvserve.kernels.cpu.build import build, compiler

log = logging.getLogger("kvserve.kernels")

ENV_SWITCH = "KVSERVE_CPU_KERNELS"

def _check(status: int, name: str) -> None:
    if status != 0:
        raise RuntimeError(f"CPU kernel {name} failed with status {status} "
                           "(1: a shape or dtype it does not take, 2: out of memory)")


class CpuKernels:
    """The loaded library. Every method takes CPU tensors of one dtype in ``DTYPES`` whose last
    dimension is contiguous (callers check with ``takes``); KV caches may be int8 instead
    (``takes_caches``). ``paged_decode`` and ``store_kv``, run per layer, trust their caller for
    the rest of their layouts; their ``*_checked`` twins check."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self._lib = lib
        fused = lib.decode_row_available()  # the fused decode step (x86): 2 with linear.c's row kernel
        self.fused_rows, self.fused_row_kernel = fused > 0, fused == 2  # (AVX-512); 1: gemm.c, AVX2 int8/int4
        self.gemm_quantized = bool(lib.gemm_bf16_quantized_available())  # int8/int4 panels (AVX-512, AVX2)
        self.attention_vector_bits = lib.attention_vector_bits()  # 512, 256 (AVX2), 0: portable loop

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """CPU tensors of one supported dtype with a contiguous last dimension (None: absent,
        e.g. no bias)."""
        dtype = tensors[0].dtype
        if dtype not in DTYPES:
            return False
        for t in tensors:  # noqa: SIM110 - a plain loop: all() over a generator costs twice as much
            if t is not None and (not t.is_cpu or t.dtype != dtype or t.stride(-1) != 1):
                return False
        return True

    takes_caches = staticmethod(takes_caches)  # abi.py: the caches the kernels read, and their codes
    cache_code = staticmethod(cache_code)

    @staticmethod
    def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the attention kernel takes this shape (the dtype is checked per call: ``takes``)."""
        return (head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= MAX_GROUP)

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor,
                     tokens: torch.Tensor, out: torch.Tensor, scale: float,
                     ctx_lens: torch.Tensor | None = None, window: int | None = None,
                     soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """For each i: ``out[tokens[i]]`` = attention of ``q[tokens[i]]`` [heads, D] over the first
        ``n`` keys/values of the blocks in ``block_tables[seq_ids[i]]``, where ``n`` is
        ``ctx_lens[i]`` when given (prefill tokens, each up to its own position), else
        ``seq_lens[seq_ids[i]]`` (decodes); with a sliding ``window``, over the last ``window``
        of them only, read from the block of the first on (tiles too: each lane its own window). With
        ``soft_cap`` each score s becomes ``cap * tanh(s / cap)``; ``sinks`` (float32 [heads],
        contiguous) join each head's softmax denominator (variants.py); either takes the portable
        loop, one query per item.

        q, out: [T, heads, D]; caches [kv_heads, blocks, block_size, D] contiguous, of q's dtype, or
        int8 [kv_heads, blocks, block_size, D + 4] (``KV_INT8`` rows: D int8 values, then their
        float32 scale; engine/layers/attention/kv_quant.py); block_tables
        int32 [S, W] with contiguous rows; seq_lens, seq_ids, tokens, ctx_lens int32, contiguous
        (``seq_lens`` is read only when ``ctx_lens`` is None). The caller guarantees these layouts,
        unchecked here (run per layer; the torch backend's tensors have them):
        ``paged_decode_checked`` is the entry that checks.
        """
        kv_heads, num_blocks, block_size = k_cache.shape[:3]
        if ctx_lens is None:  # decodes: each over its sequence's whole context
            ctx_lens = seq_lens.index_select(0, seq_ids.long())
        _check(self._lib.paged_decode(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
            block_size, block_tables.data_ptr(), block_tables.stride(0), seq_ids.data_ptr(),
            tokens.data_ptr(), ctx_lens.data_ptr(), seq_ids.numel(), q.shape[1], kv_heads, q.shape[2], scale,
            out.data_ptr(), out.stride(0), out.stride(1), DTYPES[q.dtype], self.cache_code(q.dtype, k_cache),
            window or 0, soft_cap or 0.0, 0 if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
        ), "paged_decode")

    def paged_decode_checked(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor,
                             tokens: torch.Tensor, out: torch.Tensor, scale: float,
                             ctx_lens: torch.Tensor | None = None, window: int | None = None,
                             soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        """``paged_decode`` for callers that do not guarantee its layouts: ValueError for caches
        that are not contiguous or mixed dtypes; index tensors are made contiguous."""
        if not self.takes(q, out):
            raise ValueError("paged_decode: q/out rows contiguous, q and out of one dtype")
        check_caches(q.dtype, k_cache, v_cache, q.shape[2], "paged_decode")
        if ctx_lens is not None:
            if ctx_lens.numel() != seq_ids.numel():
                raise ValueError("paged_decode: one ctx_lens entry per query")
            ctx_lens = ctx_lens.contiguous()
        block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        self.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, seq_ids.contiguous(),
                          tokens.contiguous(), out, scale, ctx_lens, window, soft_cap,
                          None if sinks is None else sinks.float().contiguous())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``weight * r / rms(r)`` over the last dimension, where ``r`` is ``x``, or, with
        ``residual``, ``residual + x`` — which is written back into ``residual``. ``x`` is 2-D, or
        3-D when there is no residual (per-head norms)."""
        rows, width = x, x.shape[-1]
        outer, inner = rows.shape[0], (rows.shape[1] if rows.dim() == 3 else 1)
        x_inner = rows.stride(1) if rows.dim() == 3 else 0
        out = torch.empty(x.shape, dtype=x.dtype)
        out_inner = out.stride(1) if out.dim() == 3 else 0
        weight = weight if weight.is_contiguous() else weight.contiguous()
        res_ptr, res_outer = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
        _check(self._lib.rms_norm(
            rows.data_ptr(), rows.stride(0), x_inner, res_ptr, res_outer, weight.data_ptr(),
            DTYPES[weight.dtype], out.data_ptr(), out.stride(0), out_inner, outer, inner, width, eps,
            DTYPES[x.dtype], torch.get_num_threads(),
        ), "rms_norm")
        return out

    def share_fp_mode(self, num_threads: int) -> None:
        """Every thread of a team of ``num_threads`` takes on this thread's floating-point mode (its
        flushing of denormals): elementwise.c ``share_fp_mode``."""
        self._lib.share_fp_mode(num_threads)

    def silu_and_mul(self, x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
        """``silu(x[:, :w]) * x[:, w:]`` for 2-D ``x`` of width ``2w`` (``gelu_tanh``: Gemma's GeGLU)."""
        rows, width = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, width, dtype=x.dtype)
        name = "gelu_tanh_and_mul" if gelu_tanh else "silu_and_mul"
        _check(getattr(self._lib, name)(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, width,
                                        DTYPES[x.dtype], torch.get_num_threads()), name)
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [tokens, heads, D] in place by rows of ``cos``/``sin`` [tokens, 1, D] (sin's
        first half negated, as ``RotaryEmbedding.cos_sin`` makes them); returns ``x``."""
        tokens, heads, width = x.shape
        if cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        _check(self._lib.rotary(x.data_ptr(), x.stride(0), x.stride(1), tokens, heads, width, cos.data_ptr(),
                                sin.data_ptr(), cos.stride(0), DTYPES[x.dtype], torch.get_num_threads()),
               "rotary")
        return x

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """``cache[h, slots[t]] = src[t, h]`` for K and V into head-major caches seen as
        [kv_heads, slots, row]; slot -1 is skipped; an int8 cache takes each row quantized
        (``KV_INT8``), and ``k`` and ``v`` then hold the values the cache holds. Caches contiguous,
        ``slots`` int64 contiguous: the caller guarantees it, unchecked here (``store_kv_checked``
        checks)."""
        tokens, kv_heads, width = k.shape
        cache_slots = k_cache.numel() // (kv_heads * k_cache.shape[-1])
        _check(self._lib.store_kv(
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(),
            tokens, kv_heads, width, k_cache.data_ptr(), v_cache.data_ptr(), cache_slots, DTYPES[k.dtype],
            self.cache_code(k.dtype, k_cache),
        ), "store_kv (a slot out of range, or an int8 row wider than MAX_HEAD_DIM)")

    def store_kv_checked(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
        """``store_kv`` for callers that do not guarantee its layouts: ValueError for caches that
        are not contiguous or slots that are not int64."""
        if slots.dtype != torch.int64:
            raise ValueError("store_kv: int64 slots")
        check_caches(k.dtype, k_cache, v_cache, k.shape[2], "store_kv")
        self.store_kv(k, v, k_cache, v_cache, slots.contiguous())

    def small_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for 2-D ``x`` of at most ``MAX_FUSED_ROWS`` rows: one pass
        over the weight, at memory speed. With ``scales``, ``weight`` is int8 [out, in] with one
        scale per output row (in x's dtype). csrc/linear.c's ``linear_rows`` where it was built for
        AVX-512 (on AVX512-VNNI, int8 weights multiply x as ``quantized_activation_block`` says),
        else elementwise.c's portable loop."""
        rows, k_in = x.shape
        n_out = weight.shape[0]
        bias_ptr = None if bias is None else bias.data_ptr()
        if scales is not None:
            if weight.dtype != torch.int8 or weight.stride(1) != 1:
                raise ValueError("small_linear: an int8 weight with contiguous rows goes with scales")
            scales = scales.contiguous()
        y = self.linear_rows(x, self.linear_of(weight, bias, scales, x.dtype))
        if y is not None:
            return y
        y = torch.empty(rows, n_out, dtype=x.dtype)
        tail = (y.data_ptr(), y.stride(0), rows, n_out, k_in, DTYPES[x.dtype], torch.get_num_threads())
        if scales is None:
            _check(self._lib.small_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                          bias_ptr, *tail), "small_linear")
        else:
            _check(self._lib.small_linear_int8(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                                               scales.data_ptr(), bias_ptr, *tail), "small_linear_int8")
        return y

    def gemm_available(self) -> bool:  # csrc/gemm.c is built for AVX-512, or AVX2 with FMA
        return bool(self._lib.gemm_bf16_available())

    def pack_gemm_weight(self, weight: torch.Tensor) -> PackedWeight | None:
        """csrc/gemm.c's packed copy of a bfloat16 weight [out, in] (rows contiguous), or None where
        it was not built or does not take the shape (``out`` a multiple of 16, ``in`` even)."""
        n_out, k_in = weight.shape
        if weight.dtype != torch.bfloat16 or weight.stride(1) != 1 or not self.gemm_available():
            return None
        data = torch.empty(n_out * k_in, dtype=torch.bfloat16)
        status = self._lib.gemm_bf16_pack(weight.data_ptr(), weight.stride(0), n_out, k_in, data.data_ptr(),
                                          torch.get_num_threads())
        return None if status == 1 else PackedWeight(data, n_out, k_in)

    def gemm(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None,
             glu: bool = False) -> torch.Tensor:
        """``x W^T + b`` for bfloat16 ``x`` [rows, in] (rows contiguous) over ``pack_gemm_weight``'s
        copy of W; ``bias`` bfloat16 or None. ``glu``: W is gate|up (``n_out / 2`` rows each, a
        multiple of 16) and the result is ``silu(gate) * up`` [rows, n_out / 2], exactly
        ``silu_and_mul`` of the product, which is never stored."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != weight.k_in:
            raise ValueError(f"gemm: bfloat16 x [rows, {weight.k_in}] with contiguous rows, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            raise ValueError("gemm: a contiguous bfloat16 bias")
        if glu and weight.n_out % 32:
            raise ValueError(f"gemm: glu takes gate|up halves of a multiple of 16 rows, got {weight.n_out}")
        y = torch.empty(x.shape[0], weight.n_out // 2 if glu else weight.n_out, dtype=torch.bfloat16)
        if x.shape[0]:
            _check(self._lib.gemm_bf16(x.data_ptr(), x.stride(0), x.shape[0], weight.data.data_ptr(),
                                       None if bias is None else bias.data_ptr(), weight.n_out, weight.k_in,
                                       y.data_ptr(), int(glu), torch.get_num_threads()), "gemm_bf16")
        return y

    def quantized_gemm(self, x: torch.Tensor, linear: Linear, glu: bool = False) -> torch.Tensor | None:
        """``x W^T + b`` for bfloat16 ``x`` [rows, in] (rows contiguous) and an int8 (bfloat16 scales)
        or int4 ``linear``, any rows: csrc/gemm.c dequantizes W a cache-sized panel at a time, never
        whole; ``glu`` as in ``gemm``; None where it was not built or does not take the weight."""
        y = torch.empty(x.shape[0], linear.n_out // 2 if glu else linear.n_out, dtype=torch.bfloat16)
        if not x.shape[0]:  # (a step of prefill chunks asks the LM head for no rows)
            return y
        status = self._lib.gemm_bf16_quantized(ctypes.byref(linear), x.data_ptr(), x.stride(0), x.shape[0],
                                               y.data_ptr(), int(glu), torch.get_num_threads())
        if status == 1:
            return None
        _check(status, "gemm_bf16_quantized")
        return y

    def row_kernel_takes(self, linear: Linear) -> bool:  # linear_rows (and the fused decode step's)
        return bool(self._lib.linear_takes(ctypes.byref(linear)))

    def linear_rows(self, x: torch.Tensor, linear: Linear) -> torch.Tensor | None:
        """``x W^T + b`` for ``linear`` (``linear_of``'s; the caller keeps its tensors alive):
        csrc/linear.c's ``linear_rows`` (AVX-512; int8 and int4 weights on AVX2 in
        linear_avx2.c), or None where it does not take the call."""
        rows = x.shape[0]
        if not x.is_contiguous() or rows > MAX_FUSED_ROWS:
            return None
        y = torch.empty(rows, linear.n_out, dtype=x.dtype)
        status = self._lib.linear_rows(ctypes.byref(linear), rows, x.data_ptr(), y.data_ptr(),
                                       DTYPES[x.dtype], torch.get_num_threads())
        if status == 1:  # not built for AVX-512 here, or int4 without AVX512-VNNI
            return None
        _check(status, "linear_rows")
        return y

    def dequantize(self, linear: Linear, dtype: torch.dtype) -> torch.Tensor | None:
        """``linear``'s int8 or int4 weight as [n_out, k_in] of ``dtype`` (csrc/dequantize.c, on
        every thread), or None where it does not take the weight."""
        out = torch.empty(linear.n_out, linear.k_in, dtype=dtype)
        status = self._lib.dequantize_weight(ctypes.byref(linear), out.data_ptr(), DTYPES[dtype],
                                             torch.get_num_threads())
        if status == 1:
            return None
        _check(status, "dequantize_weight")
        return out

    def quantized_activation_block(self, k_in: int) -> int:
        """How the row kernels multiply int8 and int4 weights by activations of width ``k_in``: with
        AVX512-VNNI or AVX2, ``k_in`` a multiple of 64, x quantized per this many values (scale =
        max|x| / 127, magnitudes to nearest even), summed in integers; 0: floats (no int4)."""
        return self._lib.quantized_activation_block(k_in)

    @staticmethod
    def linear_of(weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor | None,
                  dtype: torch.dtype, groups: torch.Tensor | None = None) -> Linear:
        """``Linear`` for ``weight`` [out, in] (int8 when ``scales`` is given; int4, two values a
        byte, when ``groups`` is), rows contiguous."""
        kind = W_INT8 if scales is not None else (W_INT4 if groups is not None else DTYPES[dtype])
        k_in = weight.shape[1] * (2 if groups is not None else 1)
        scales, bias, groups = (None if t is None else t.data_ptr() for t in (scales, bias, groups))
        return Linear(weight.data_ptr(), weight.stride(0) * weight.element_size(), kind, scales, bias,
                      weight.shape[0], k_in, groups)

    def decode_row(self, layers: ctypes.Array, step: RowStep, hidden: torch.Tensor,
                   residual: torch.Tensor) -> bool:
        """One token per row through every layer of ``layers`` (csrc/decode_row.c): ``hidden``
        [rows, H] in, the last layer's output out; ``residual`` [rows, H] out. False where the
        library was not built for AVX-512 or refused the step (nothing was done)."""
        status = self._lib.decode_row(ctypes.addressof(layers), len(layers), ctypes.byref(step),
                                      hidden.data_ptr(), residual.data_ptr(), torch.get_num_threads())
        if status == 1:
            return False
        _check(status, "decode_row")
        return True

    def inverse_cdf_draw(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: per row of float32 ``logits`` (overwritten), the token whose interval of
        the cumulative softmax holds ``uniforms[row]`` of the total (``sampler._inverse_cdf_draw``)."""
        rows, width = logits.shape
        uniforms = uniforms.to(torch.float32).contiguous()
        out = torch.empty(rows, dtype=torch.int64)
        _check(self._lib.inverse_cdf_draw(logits.data_ptr(), logits.stride(0), rows, width,
                                          uniforms.data_ptr(), out.data_ptr(), torch.get_num_threads()),
               "inverse_cdf_draw")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: ``logits.argmax(-1)`` of 2-D float32 logits (first maximum; first NaN)."""
        rows, width = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        _check(self._lib.argmax_rows(logits.data_ptr(), logits.stride(0), rows, width, out.data_ptr(),
                                     torch.get_num_threads()), "argmax_rows")
        return out


@functools.cache
def load_kernels() -> CpuKernels | None:
    """The kernels, built if needed; None when disabled or unbuildable (logged once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        log.info("%s=0: the CPU path runs torch ops only", ENV_SWITCH)
        return None
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, or $CC) found: the CPU path runs torch ops only (slower)")
        return None
    try:
        return CpuKernels(build(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("building the CPU kernels failed, the CPU path runs torch ops only: %s", exc)
        return None


def kernels_for(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernels when they take these tensors (CPU, one dtype of ``DTYPES``, contiguous rows)."""
    if not CpuKernels.takes(*tensors):
        return None
    return load_kernels()
