"""CUDA graphs for decode steps: which batch sizes are captured, how a batch is padded to
one of them, and the runner that captures and replays the graphs.

A decode step feeds the model one token per sequence. Graphs are captured for a ladder of
batch sizes (1, 2, 4, 8, then every 16) and a batch runs in the smallest captured size that
holds it; the extra rows are padding that writes no K/V (slot -1) and attends to no keys
(seq_len 0). Block tables are as wide as ``max_model_len`` needs, so no request can outgrow
the captured width. Prefill, and decode batches above the largest size, run eagerly.

Graphs are used on CUDA unless ``enforce_eager``, and only with attention backends whose decode
path reads device tensors alone (Triton, flash-attn); the torch backend plans each step on the
host, which a graph cannot see. Only ``record_cuda_graph`` needs CUDA; sizes, buckets, padding
and the runner's bookkeeping are plain tensor code that the tests run on the CPU with a recorder
that replays by re-running the captured body.

Models with a recurrent state (the hybrids' Gated DeltaNet layers) step their state slots in
place: the step's slot numbers are one more static buffer (``state_slots``, read by the layers as
``AttentionMetadata.state_index``), and padded rows step the state cache's scratch row, which no
sequence holds. A step whose rows share a slot (a speculative verification: its rows step the
slot in turn and keep the state for a rollback) runs eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from kvserve.engine.layers.attention.backend import AttentionMetadata
from kvserve.engine.model_input import ModelInput, block_table_width, step_block_tables

MAX_CAPTURE_SIZE = 512
GRAPH_BACKENDS = frozenset({"triton", "flash-attn"})  # decode reads only device tensors
_LADDER = (1, 2, 4, 8, *range(16, MAX_CAPTURE_SIZE + 1, 16))

# What a padded row holds: token 0 at position 0, no K/V written, no keys read.
PAD_VALUES = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0, "block_tables": 0}


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 32, ... up to the first one that holds
    ``max_num_seqs`` (so every allowed batch has a size), at most ``MAX_CAPTURE_SIZE``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    limit = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = []
    for size in _LADDER:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= ``batch_size``; None when the batch must run eagerly."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def decode_graphs_enabled(enforce_eager: bool, backend_name: str, device: torch.device,
                          test_recorder: bool = False) -> bool:
    """Whether decode steps run as graphs: on CUDA (or anywhere with a test's recorder), unless
    ``enforce_eager``, and only with a backend in ``GRAPH_BACKENDS``."""
    return not enforce_eager and backend_name in GRAPH_BACKENDS and (device.type == "cuda" or test_recorder)


@dataclass
class DecodeInputs:
    """One row per sequence of a decode step."""

    input_ids: torch.Tensor  # [B] int64: the last sampled token
    positions: torch.Tensor  # [B] int64: its position
    slot_mapping: torch.Tensor  # [B] int64: where its K/V goes; -1 writes nothing
    seq_lens: torch.Tensor  # [B] int32: keys to attend to, this token included
    block_tables: torch.Tensor  # [B, width] int32
    state_slots: torch.Tensor | None = None  # [B] int64: each row's state slot (models with a state)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, n: int) -> DecodeInputs:
        """Views of the first ``n`` rows (the same storage)."""
        return DecodeInputs(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[:n]
                               for f in fields(self)})


def decode_inputs(inp: ModelInput, pin: bool, state_slots: list[int] | None = None) -> DecodeInputs:
    """A decode step's rows as host tensors (in pinned memory when ``pin``, so that
    ``copy_padded`` can copy them to the device without blocking); the block tables are the step's
    array (``model_input.step_block_tables``); ``state_slots``: the rows' state slots, if any."""
    tables = torch.from_numpy(step_block_tables(inp))
    slots = None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64, pin_memory=pin)
    return DecodeInputs(
        input_ids=torch.tensor(inp.input_ids, dtype=torch.int64, pin_memory=pin),
        positions=torch.tensor(inp.positions, dtype=torch.int64, pin_memory=pin),
        slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.int64, pin_memory=pin),
        seq_lens=torch.tensor(inp.context_lens, dtype=torch.int32, pin_memory=pin),
        block_tables=tables.pin_memory() if pin else tables,
        state_slots=slots,
    )


def allocate_static_inputs(max_batch: int, width: int, device: torch.device | str,
                           state_pad_row: int | None = None) -> DecodeInputs:
    """Buffers that captured graphs read from, every row holding the padding values; with
    ``state_pad_row`` (the state cache's scratch row) a buffer of state slots too."""
    device = torch.device(device)
    buffers = DecodeInputs(
        input_ids=torch.empty(max_batch, dtype=torch.int64, device=device),
        positions=torch.empty(max_batch, dtype=torch.int64, device=device),
        slot_mapping=torch.empty(max_batch, dtype=torch.int64, device=device),
        seq_lens=torch.empty(max_batch, dtype=torch.int32, device=device),
        block_tables=torch.empty(max_batch, width, dtype=torch.int32, device=device),
    )
    for name, value in PAD_VALUES.items():
        getattr(buffers, name).fill_(value)
    if state_pad_row is not None:
        buffers.state_slots = torch.full((max_batch,), state_pad_row, dtype=torch.int64, device=device)
    return buffers


def copy_padded(static: DecodeInputs, inputs: DecodeInputs, bucket: int,
                state_pad_row: int | None = None) -> DecodeInputs:
    """Copy ``inputs`` into the first rows of ``static``, pad the rest of ``bucket`` rows (state
    slots with ``state_pad_row``), and return views of those ``bucket`` rows."""
    batch, width = inputs.batch_size, inputs.block_tables.shape[1]
    if (static.state_slots is None) != (inputs.state_slots is None):
        raise ValueError("the step's state slots and the graphs' state slot buffer come together: "
                         f"{'no' if inputs.state_slots is None else 'a'} step slots, "
                         f"{'no' if static.state_slots is None else 'a'} buffer")
    if not batch <= bucket <= static.batch_size:
        raise ValueError(f"batch {batch} does not fit bucket {bucket} ({static.batch_size} buffer rows)")
    if width > static.block_tables.shape[1]:
        raise ValueError(
            f"block_tables has {width} columns but the graphs were captured for "
            f"{static.block_tables.shape[1]} (max_model_len / block_size): a sequence outgrew max_model_len"
        )
    padded = static.rows(bucket)
    for name, pad in PAD_VALUES.items():
        dst, src = getattr(padded, name), getattr(inputs, name)
        dst[batch:].fill_(pad)
        if name == "block_tables":
            dst[:batch, :width].copy_(src, non_blocking=True)
            dst[:batch, width:].fill_(pad)
        else:
            dst[:batch].copy_(src, non_blocking=True)
    if static.state_slots is not None:
        padded.state_slots[:batch].copy_(inputs.state_slots, non_blocking=True)
        padded.state_slots[batch:].fill_(state_pad_row)
    return padded


def decode_metadata(inputs: DecodeInputs, block_size: int) -> AttentionMetadata:
    """Attention metadata over (static) decode buffers, for backends whose decode path reads only
    ``slot_mapping``, ``seq_lens`` and ``block_tables`` (Triton, flash-attn) and picks it by
    ``max_query_len == 1``. The host-side lists are placeholders: a captured graph cannot see them."""
    batch = inputs.batch_size
    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=inputs.slot_mapping,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=inputs.seq_lens.device),
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        max_query_len=1,
        max_seq_len=inputs.block_tables.shape[1] * block_size,
        num_decode_tokens=batch,
        query_lens_host=[1] * batch,
        seq_lens_host=[0] * batch,
        state_index=inputs.state_slots,
    )


class Graph(Protocol):
    def replay(self) -> None: ...
    def pool(self) -> Any: ...


def record_cuda_graph(body: Callable[[], None], pool: Any) -> Graph:
    """Capture ``body``'s CUDA work into a graph that may share ``pool`` with earlier ones."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


Recorder = Callable[[Callable[[], None], Any], Graph]  # (body, pool) -> graph; record_cuda_graph's shape
Forward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


class CudaGraphRunner:
    """Captures one graph per decode batch size and replays the one a batch fits.

    ``forward(input_ids, positions, attn_metadata) -> hidden`` is the model up to the final
    norm (the LM head runs outside the graph). ``build_metadata(inputs)`` makes the attention
    metadata from the static buffers' views; it is called once per size at capture time, so
    the metadata must hold those views and no host-side values derived from them.
    ``record`` is the capture primitive, ``record_cuda_graph`` unless a test swaps it.
    """

    def __init__(
        self,
        forward: Forward,
        build_metadata: Callable[[DecodeInputs], Any],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str,
        record: Recorder = record_cuda_graph,
        state_pad_row: int | None = None,
    ) -> None:
        device = torch.device(device)
        if record is record_cuda_graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}; run decode eagerly instead")
        self.forward = forward
        self.build_metadata = build_metadata
        self.sizes = capture_sizes(max_num_seqs)
        width = block_table_width(max_model_len, block_size)
        self.state_pad_row = state_pad_row  # the state cache's scratch row, for models with a state
        self.static = allocate_static_inputs(self.sizes[-1], width, device, state_pad_row)
        self.record = record
        self.graphs: dict[int, Graph] = {}
        self.captured: list[int] = []  # sizes with a graph, ascending
        self.hidden: torch.Tensor | None = None
        self.pool: Any = None  # the memory pool every graph shares, once the first is captured

    @torch.no_grad()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Warm up and capture ``sizes`` (default: every size), largest first, all in one memory
        pool so that the smaller graphs reuse the largest one's memory."""
        sizes = self.sizes if sizes is None else sizes
        if not set(sizes) <= set(self.sizes):
            raise ValueError(f"sizes {sorted(set(sizes) - set(self.sizes))} are not among {self.sizes}")
        for size in sorted(sizes, reverse=True):
            inputs = self.static.rows(size)
            metadata = self.build_metadata(inputs)
            warm = self.forward(inputs.input_ids, inputs.positions, metadata)  # compiles kernels, picks algos
            if self.hidden is None:
                shape = (self.sizes[-1], *warm.shape[1:])
                self.hidden = torch.empty(shape, dtype=warm.dtype, device=warm.device)
            del warm
            self.graphs[size] = self.record(self._body(size, inputs, metadata), self.pool)
            if self.pool is None:
                self.pool = self.graphs[size].pool()
        self.captured = sorted(self.graphs)
        if self.static.input_ids.is_cuda:
            torch.cuda.synchronize()

    def _body(self, size: int, inputs: DecodeInputs, metadata: Any) -> Callable[[], None]:
        def body() -> None:
            self.hidden[:size].copy_(self.forward(inputs.input_ids, inputs.positions, metadata))

        return body

    def can_replay(self, batch_size: int) -> bool:
        return bucket_for(batch_size, self.captured) is not None

    def fits(self, inp: ModelInput) -> bool:
        """Whether a graph can run this step: decode-only (every query length 1), a captured size
        holds it, no block table is wider than the captured width and, with state slots, no two
        rows share a slot (a verification's rows; else it runs eagerly)."""
        return (
            inp.num_seqs > 0
            and inp.is_decode_only
            and self.can_replay(inp.num_seqs)
            and step_block_tables(inp).shape[1] <= self.static.block_tables.shape[1]
            and (self.state_pad_row is None or len(set(inp.state_slots)) == len(inp.state_slots))
        )

    def replay(self, inputs: DecodeInputs) -> torch.Tensor:
        """Hidden states ``[batch, ...]`` for ``inputs``: a view of the runner's output buffer,
        valid until the next replay."""
        bucket = bucket_for(inputs.batch_size, self.captured)
        if bucket is None:
            raise ValueError(f"no captured graph holds a batch of {inputs.batch_size}; run it eagerly")
        copy_padded(self.static, inputs, bucket, self.state_pad_row)
        self.graphs[bucket].replay()
        return self.hidden[: inputs.batch_size]

    def close(self) -> None:
        """Drop the graphs and their memory pool."""
        self.graphs.clear()
        self.captured = []
        self.hidden = None
        self.pool = None
