"""Paged attention behind one small interface, in vLLM's split.

- ``AttentionBackend``: built once per model runner. ``build_metadata(inp, device)`` turns a
  step's ``ModelInput`` into an ``AttentionMetadata`` once per step; ``create_impl(...)`` makes
  the per-layer ``AttentionImpl``.
- ``AttentionImpl.forward(q, k, v, k_cache, v_cache, meta)``: writes the new K/V into the paged
  cache at ``meta.slot_mapping`` (slot -1 = skip) and returns attention over the cached K/V.
- ``Attention``: the nn.Module a model holds per layer; it owns the layer's cache views.

KV cache layout: each backend allocates the cache in the layout it reads
(``AttentionBackend.kv_cache_shape``). The kernels' layout, the default, is per layer ``k_cache``
and ``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]; the torch backend's is
head-major, [num_kv_heads, num_blocks, block_size, head_dim]. Either way token slot ``s`` is row
``s % block_size`` of block ``s // block_size``. The cache holds the model's dtype
(``kv_cache_dtype="auto"``); the torch backend also keeps an int8 cache (``"int8"``: rows of
head_dim int8 values and their float32 scale, engine/layers/attention/kv_quant.py), half the bytes of
bfloat16 to store and to read.

Position rule every backend implements: query token j of a sequence with query length q and
context length L (cached + new tokens) sits at position L - q + j and attends to keys 0..L-q+j.
This covers full prefills, prefix-cache hits, chunked-prefill continuations and decodes alike.

Attention variants a layer asks for at ``create_impl`` (keywords; a backend that cannot compute
one refuses it there with a ValueError naming the variant and the backend, never later):
- ``sliding_window=W``: the query at position p attends keys max(0, p - W + 1) .. p only, as
  transformers 5.24's ``masking_utils.sliding_window_overlay`` (``kv_idx > q_idx - W``) on top of
  the causal mask. A backend must never read keys below that bound: the cache manager may have
  freed (and reused) the blocks that held them.
- ``logits_soft_cap=c``: scores become c * tanh(score / c) before the softmax (Gemma 2).
- ``sinks=True``: a learned per-head logit joins each softmax's denominator (gpt-oss); the
  ``Attention`` module owns the parameter and passes it to ``forward(..., sinks=tensor)``.

Backends are looked up by name in ``BACKENDS`` ("module:Class"), imported on first use, so a
backend in its own file needs only its entry there.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvserve.engine.model_input import ModelInput, step_block_tables

BACKENDS = {
    "torch": "kvserve.engine.layers.attention.cpu_backend:CpuAttentionBackend",
    "triton": "kvserve.engine.layers.attention.triton_backend:TritonAttentionBackend",
    "flash-attn": "kvserve.engine.layers.attention.flash_backend:FlashAttentionBackend",
}
AUTO_ORDER_CUDA = ("flash-attn", "triton", "torch")
FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn's paged KV takes only blocks of a multiple of this


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer. Tensors live on the model's device."""

    block_size: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = do not store
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cu_seqlens_q
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int  # tokens of sequences whose query length is 1
    query_lens_host: list[int]  # host copies, for planning without a device sync
    seq_lens_host: list[int]
    # with several KV cache groups (engine/runner/kv_groups.py): every group's metadata, this one
    # first; each ``Attention`` module reads its own group's
    group_metadata: list[AttentionMetadata] | None = None
    # models with a recurrent state (engine/runner/state_cache.py): each sequence's state slot
    state_slots: list[int] | None = None
    # the same slots as a device tensor, distinct per row, where a captured decode graph reads them
    # (its static buffer: padded rows hold the state cache's scratch row); None: use state_slots
    state_index: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host numbers (a list, or a numpy array) as a tensor of ``dtype`` on ``device``; on CUDA
    through pinned memory without blocking, so building a step's inputs never waits for the GPU
    to finish queued work. Lists go through numpy, which reads a list of ints ~3x faster than
    ``torch.tensor`` does."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if not isinstance(values, np.ndarray):
        values = np.array(values, dtype=np_dtype)
    elif np_dtype is not None and values.dtype != np_dtype:
        values = values.astype(np_dtype)
    host = torch.from_numpy(values)
    if host.dtype != dtype:  # torch's .to costs a few microseconds even when it has nothing to do
        host = host.to(dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def common_metadata_fields(inp: ModelInput, block_size: int, device: torch.device) -> dict:
    """The ``AttentionMetadata`` fields every backend needs, as keyword arguments."""
    query_start = np.zeros(len(inp.query_lens) + 1, dtype=np.int32)
    np.cumsum(inp.query_lens, out=query_start[1:])
    return dict(
        block_size=block_size,
        slot_mapping=to_device(inp.slot_mapping, device),
        query_start_loc=to_device(query_start, device, torch.int32),
        seq_lens=to_device(inp.context_lens, device, torch.int32),
        block_tables=to_device(step_block_tables(inp), device, torch.int32),
        max_query_len=max(inp.query_lens, default=0),
        max_seq_len=max(inp.context_lens, default=0),
        num_decode_tokens=inp.query_lens.count(1),
        query_lens_host=list(inp.query_lens),
        seq_lens_host=list(inp.context_lens),
    )


class AttentionImpl(ABC):
    """One layer's attention computation; holds shapes and its variant (``sliding_window``,
    ``logits_soft_cap``, ``has_sinks``: see the module docstring), no per-step state."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: bool = False):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.has_sinks = sinks

    @property
    def attends_in_c(self) -> bool:
        """Whether csrc/attention.c attends over this layer's cache (the CPU backend, at the shapes
        its kernels take): the fused decode step (models/decode_row.py) runs over such layers only
        (each reading its own KV cache group's block tables)."""
        return False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv_heads, D] -> output [T, heads, D]."""


class AttentionBackend(ABC):
    name: str = ""
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # the cache element types this backend reads
    # the attention variants this backend computes: "sliding_window", "logits_soft_cap", "sinks"
    variants: frozenset[str] = frozenset()

    def __init__(self, block_size: int, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in self.kv_cache_dtypes:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not read by the {self.name} attention "
                             f"backend (it takes {', '.join(self.kv_cache_dtypes)}); the int8 cache needs "
                             "--attention-backend torch")
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's K (and V) cache in the layout this backend reads."""
        return (num_blocks, self.block_size, num_kv_heads, head_dim)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The element type of the cache tensors for a model in ``model_dtype``."""
        return torch.int8 if self.kv_cache_dtype == "int8" else model_dtype

    @abstractmethod
    def build_metadata(self, inp: ModelInput, device: torch.device) -> AttentionMetadata:
        """Called once per step, before the forward pass."""

    @abstractmethod
    def create_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: bool = False) -> AttentionImpl:
        """Called once per layer when the model is built; the keywords ask for an attention
        variant (module docstring), refused by ``check_variants`` when this backend lacks it."""

    def check_variants(self, sliding_window: int | None, logits_soft_cap: float | None, sinks: bool) -> None:
        """Raises ValueError naming the variant and this backend when it cannot compute one asked for."""
        whole = isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
        if sliding_window is not None and not (whole and sliding_window >= 1):
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap!r}")
        asked = {"sliding_window": sliding_window is not None, "logits_soft_cap": logits_soft_cap is not None,
                 "sinks": bool(sinks)}
        for variant, wanted in asked.items():
            if wanted and variant not in self.variants:
                raise ValueError(f"attention variant {variant} is not implemented by the {self.name} "
                                 "attention backend")


class Attention(nn.Module):
    """A model's attention layer: runs its impl over this layer's slice of the KV cache.

    ``sinks``: for an impl made with ``sinks=True``, the index of this rank's first head in the
    checkpoint's per-head sinks (``rank * num_heads``); the layer then owns ``sinks``, the logits
    of its ``impl.num_heads`` heads, which load from the checkpoint's ``...self_attn.sinks``."""

    def __init__(self, impl: AttentionImpl, sinks: int | None = None):
        super().__init__()
        if impl.has_sinks != (sinks is not None):
            raise ValueError("an attention impl with sinks needs Attention(impl, sinks=first head), "
                             "and only such an impl takes sinks")
        self.impl = impl
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv_group = 0  # the KV cache group whose block tables this layer's cache is read with
        self.sinks = None
        if sinks is not None:
            self.sinks = nn.Parameter(torch.zeros(impl.num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
            self._first_head = sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        heads = param.shape[0]
        if loaded.dim() != 1 or loaded.shape[0] < self._first_head + heads:
            raise ValueError(f"checkpoint sinks of shape {tuple(loaded.shape)} lack heads "
                             f"{self._first_head}..{self._first_head + heads - 1}")
        param.data.copy_(loaded[self._first_head : self._first_head + heads])

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, group: int = 0) -> None:
        self.k_cache, self.v_cache, self.kv_group = k_cache, v_cache, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if meta.group_metadata is not None:  # models pass the step's; the layer reads its group's
            meta = meta.group_metadata[self.kv_group]
        if self.sinks is not None:
            return self.impl.forward(q, k, v, self.k_cache, self.v_cache, meta, sinks=self.sinks)
        return self.impl.forward(q, k, v, self.k_cache, self.v_cache, meta)


FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)  # flash-attn computes in half precision only


def resolve_backend_name(name: str, device: torch.device, block_size: int,
                         dtype: torch.dtype | None = None, needs: frozenset[str] = frozenset()) -> str:
    """``auto``: the torch backend on CPU; on CUDA the first of flash-attn (only when
    ``flash_attn_refusal`` has nothing against it), triton, torch that imports and computes the
    attention variants the model ``needs`` (gpt-oss's sinks: not flash-attn 2's, so Triton)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    for candidate in AUTO_ORDER_CUDA:
        if candidate == "flash-attn" and flash_attn_refusal(block_size, dtype):
            continue
        try:
            if needs <= _backend_class(candidate).variants:
                return candidate
        except ImportError:
            continue
    return "torch"


def flash_attn_refusal(block_size: int, dtype: torch.dtype | None) -> str | None:
    """Why flash-attn cannot serve this block size and dtype (None: not known yet, not checked),
    or None when it can."""
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        multiple = FLASH_ATTN_BLOCK_MULTIPLE
        return (f"needs block_size to be a multiple of {multiple} (flash-attn's paged KV limit), "
                f"got block_size={block_size}; pass --block-size {multiple} or --attention-backend triton")
    if dtype is not None and dtype not in FLASH_ATTN_DTYPES:
        return (f"needs dtype float16 or bfloat16 (flash-attn has no {str(dtype).removeprefix('torch.')} "
                "kernels), got dtype=" + str(dtype).removeprefix("torch.")
                + "; pass --dtype bfloat16 or --attention-backend triton")
    return None


def create_attention_backend(name: str, device: torch.device, block_size: int,
                             dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto",
                             needs: frozenset[str] = frozenset()) -> AttentionBackend:
    """The backend called ``name`` ("auto", "torch", "triton", "flash-attn") for ``device``
    and a model in ``dtype`` whose layers ask for the attention variants ``needs`` (``auto``
    picks a backend that computes them), with a cache of ``kv_cache_dtype`` ("auto": the model's
    dtype)."""
    if kv_cache_dtype != "auto" and device.type != "cpu":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is a CPU cache (the torch backend's C kernels "
                         f"read it); on {device.type} leave kv_cache_dtype at 'auto'")
    resolved = resolve_backend_name(name, device, block_size, dtype, needs)
    if resolved == "flash-attn":
        refusal = flash_attn_refusal(block_size, dtype)
        if refusal:
            raise ValueError(f"attention_backend 'flash-attn' {refusal}")
    return _backend_class(resolved)(block_size=block_size, kv_cache_dtype=kv_cache_dtype)


def _backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {['auto', *BACKENDS]}, got {name!r}")
    module_name, class_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"attention backend {name!r} is not available: {exc}") from exc
    return getattr(module, class_name)
