"""The token embedding and the LM head, split across tensor-parallel ranks by vocabulary rows.

Each rank holds ``ceil(vocab / tp)`` rows (the last shard padded with zero rows). The embedding
looks up the ids in its range and all-reduces; the LM head computes its slice of the logits and
gathers them on rank 0, which trims the padding. A GGUF file's table in a block format
(``gguf_linear.GGUFTensor``) stays as stored: lookups dequantize the rows they take, and the LM
head (its own table, or the embedding's when tied) multiplies it as a ``GGUFWeight`` (repacked as
the projections are).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.cpu_matmul import Packed, linear
from kvserve.engine.layers.gguf_linear import GGUFTensor, GGUFWeight, gguf_weight
from kvserve.engine.layers.quantization import QuantizedWeight, quantize_int8
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = parallel or ParallelContext()
        self.vocab_size = vocab_size
        self.shard_rows = math.ceil(vocab_size / self.parallel.size)
        self.vocab_start = self.parallel.rank * self.shard_rows
        self.vocab_end = min(self.vocab_start + self.shard_rows, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.shard_rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | GGUFTensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint embedding of shape {tuple(loaded.shape)} does not fit "
                f"vocab_size {self.vocab_size} x hidden {param.shape[1]}"
            )
        rows = self.vocab_end - self.vocab_start
        if isinstance(loaded, GGUFTensor):  # kept on the parameter: a tied LM head shares it
            param.gguf_table = loaded.narrow(0, self.vocab_start, rows)
            return
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])

    def finish_loading(self) -> None:
        """After every tensor is loaded: a table loaded as GGUF blocks replaces the float one."""
        table = getattr(self.weight, "gguf_table", None)
        if table is not None:
            # the loaded parameter's attributes (not the parameter: its float storage goes), where a
            # tied LM head puts its repacked copy of the table
            self._table_attrs = vars(self.weight)
            self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1], dtype=self.weight.dtype),
                                       requires_grad=False)

    @property
    def table(self) -> GGUFTensor | None:
        """This shard's rows as a GGUF file stores them, or as a tied LM head repacked them (the
        lookups then read that copy, and the file's pages are handed back: each lookup from the
        mapping made ~40 KB of it resident, the kernel mapping the cached pages around the faulting
        one, until the whole table was)."""
        attrs = getattr(self, "_table_attrs", None)
        return None if attrs is None else attrs["gguf_table"]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this shard's table."""
        if self.table is None:
            return F.embedding(ids, self.weight)
        flat = self.table.dequantize(self.weight.dtype, ids.reshape(-1))
        return flat.view(*ids.shape, flat.shape[-1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.size == 1:
            return self.lookup(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_shard
        y = self.lookup(local_ids) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.parallel.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary; rank 0 gets them all, other ranks get None."""

    quantized: QuantizedWeight | GGUFWeight | None = None  # the quantized copy, once quantized
    packed: Packed | None = None  # pack_weight's blocked copy, on the CPU

    def quantize(self, method: str) -> None:
        """An int8 copy for the logits, whatever ``method`` the projections take (see
        ``quantize_model``); the float table stays (it may be the tied embedding's)."""
        self.quantized = quantize_int8(self.weight.data)

    def finish_loading(self) -> None:
        """A table loaded as GGUF blocks (its own, or the tied embedding's) is multiplied as stored,
        repacked where the projections are (``GGUFTensor.repacked``: not in float32; a tied
        embedding then looks its rows up in the repacked copy); this shard's padding rows stay zero."""
        table = getattr(self.weight, "gguf_table", None)
        if table is not None:
            self.quantized = gguf_weight(self.weight.data, [(0, table)],
                                         repack=self.weight.dtype != torch.float32)
            self.weight.gguf_table = dict(self.quantized.parts)[0]  # a tied embedding's lookups read it
            self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1], dtype=self.weight.dtype),
                                       requires_grad=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.quantized is not None:
            logits = self.quantized.linear(hidden_states)
        else:
            # a decode step's rows (up to MAX_FUSED_ROWS) row by row alike, as the fused decode step
            # computes the layers: a speculative verification row's logits are those of a plain decode
            logits = linear(hidden_states, self.weight, packed=self.packed, few_rows=MAX_FUSED_ROWS)
        if self.parallel.size == 1:
            return logits
        logits = self.parallel.gather_last_dim(logits)
        return None if logits is None else logits[..., : self.vocab_size]
