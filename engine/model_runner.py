"""The model runner: the data plane of one tensor-parallel rank.

It loads the model (config, weights, dtype, device), sizes and allocates the paged KV cache and
executes one ``ModelInput`` per step, returning float32 logits for the rows the scheduler asked
for. ``prepare_inputs`` turns a step's lists into device tensors and attention metadata for an
eager pass; on CUDA, decode steps replay captured graphs instead (``engine/cuda_graphs.py``).

On CUDA a step's inputs go to the device from pinned host memory without blocking, and nothing
in a step waits for the device: the one read-back is the sampler's, of the sampled tokens.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.cuda_graphs import (
    CudaGraphRunner,
    Recorder,
    decode_graphs_enabled,
    decode_inputs,
    decode_metadata,
    record_cuda_graph,
)
from kvserve.engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    create_attention_backend,
    to_device,
)
from kvserve.engine.loader import (
    load_hf_config,
    load_weights,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from kvserve.engine.model_input import ModelInput
from kvserve.engine.models import build_model
from kvserve.engine.models.llama import head_dim_of
from kvserve.engine.parallel import ParallelContext

GiB = 1 << 30


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    logits_indices: torch.Tensor  # int64 [num_logits]
    attn_metadata: AttentionMetadata


def prepare_inputs(inp: ModelInput, backend: AttentionBackend, device: torch.device) -> PreparedBatch:
    """One step's ``ModelInput`` as device tensors plus the backend's attention metadata."""
    assert len(inp.input_ids) == len(inp.positions) == len(inp.slot_mapping) == sum(inp.query_lens)
    assert len(inp.query_lens) == len(inp.context_lens) == len(inp.block_tables)
    return PreparedBatch(
        input_ids=to_device(inp.input_ids, device),
        positions=to_device(inp.positions, device),
        logits_indices=to_device(inp.logits_indices, device),
        attn_metadata=backend.build_metadata(inp, device),
    )


def flush_denormals(device: torch.device) -> None:
    """Treat denormal floats as zero on CPU. The dequantized weights hold a few, and x86 handles
    denormals in microcode: measured here, a float32 decode step ran up to 10x slower with them.
    Threads inherit the setting, so it is set in the stepping thread before its first parallel op."""
    if device.type == "cpu":
        torch.set_flush_denormal(True)


class ModelRunner:
    """``record_graph`` replaces CUDA graph capture (tests pass a recorder that works on the CPU)."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None,
                 record_graph: Recorder | None = None):
        if parallel is None and config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs the ParallelContext of this worker's rank")
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.source = resolve_model(config.model)
        self.hf_config = load_hf_config(self.source)
        self._check_max_model_len()
        self.device = self._pick_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        flush_denormals(self.device)
        self.block_size = config.block_size
        self.graphs: CudaGraphRunner | None = None
        self.backend = create_attention_backend(config.attention_backend, self.device, config.block_size)
        self.attention_backend_name = self.backend.name
        self.model = build_model(self.hf_config, self.dtype, self.device, self.parallel, self.backend)
        load_weights(self.model, self.source, show_progress=self.parallel.rank == 0)  # one bar, not N
        self.vocab_size = self.hf_config.vocab_size
        self.num_kv_blocks = self.parallel.min_over_ranks(self._count_kv_blocks())
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.graphs = self._capture_decode_graphs(record_graph)

    # -- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        """float32 logits [len(inp.logits_indices), vocab] (None on ranks other than 0)."""
        flush_denormals(self.device)  # per thread: the engine may step from another thread
        if self.graphs is not None and self.graphs.fits(inp):
            hidden = self.graphs.replay(decode_inputs(inp, pin=self.device.type == "cuda"))
            logits_indices = to_device(inp.logits_indices, self.device)
        else:
            batch = prepare_inputs(inp, self.backend, self.device)
            hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
            logits_indices = batch.logits_indices
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        return None if logits is None else logits.float()

    def shutdown(self) -> None:
        """Free the graphs, the KV cache and the weights; the runner cannot execute afterwards."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._unbind_kv_cache()
        self.kv_cache = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- set-up --------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len or self.hf_config.max_position_embeddings

    def _capture_decode_graphs(self, record_graph: Recorder | None) -> CudaGraphRunner | None:
        """Decode graphs over the bound KV cache, or None where decode runs eagerly."""
        if not decode_graphs_enabled(self.config.enforce_eager, self.backend.name, self.device,
                                     test_recorder=record_graph is not None):
            return None
        graphs = CudaGraphRunner(
            self.model, lambda inputs: decode_metadata(inputs, self.block_size), self.config.max_num_seqs,
            self.max_model_len, self.block_size, self.device, record=record_graph or record_cuda_graph,
        )  # fmt: skip
        graphs.capture()
        return graphs

    def _check_max_model_len(self) -> None:
        limit = self.hf_config.max_position_embeddings
        if self.config.max_model_len is not None and self.config.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )

    def _pick_device(self) -> torch.device:
        device = resolve_device(self.config.device)
        if device.type == "cuda":
            device = torch.device("cuda", self.parallel.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        return device

    @property
    def kv_heads_per_rank(self) -> int:
        return self.model.model.layers[0].self_attn.num_kv_heads

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes: K and V, every layer, ``block_size`` tokens."""
        per_token = self.kv_heads_per_rank * head_dim_of(self.hf_config) * self.dtype.itemsize
        return 2 * self.hf_config.num_hidden_layers * self.block_size * per_token

    def _count_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            budget = self._free_gpu_bytes_after_warm_up()
        else:
            budget = int(self.config.kv_cache_memory * GiB)
        blocks = budget // self.kv_block_bytes
        if blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache: one block needs {self.kv_block_bytes} bytes; "
                "raise kv_cache_memory / gpu_memory_utilization or set num_kv_blocks"
            )
        return blocks

    def _free_gpu_bytes_after_warm_up(self) -> int:
        """Free GPU memory once the largest step's activations are set aside (measured by running
        that step over a scratch KV cache just big enough for it)."""
        warm_up = self._warm_up_input()
        scratch = self._allocate_kv_cache(sum(len(table) for table in warm_up.block_tables))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.execute_model(warm_up)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        self._unbind_kv_cache()
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total * self.config.gpu_memory_utilization - (total - free) - activations)

    def _warm_up_input(self) -> ModelInput:
        """The largest prefill one step can hold: ``max_num_batched_tokens`` tokens in sequences
        of at most ``max_model_len``, with blocks numbered from 0."""
        max_len = self.max_model_len
        tokens = self.config.max_num_batched_tokens
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        lens = lens[: self.config.max_num_seqs]
        inp = ModelInput([], [], [], [], [], [], [])
        next_block = 0
        for n in lens:
            table = list(range(next_block, next_block + -(-n // self.block_size)))
            next_block += len(table)
            inp.input_ids += [0] * n
            inp.positions += range(n)
            inp.slot_mapping += [table[p // self.block_size] * self.block_size + p % self.block_size
                                 for p in range(n)]
            inp.query_lens.append(n)
            inp.context_lens.append(n)
            inp.block_tables.append(table)
            inp.logits_indices.append(len(inp.input_ids) - 1)
        return inp

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; each layer gets views.

        Zeroed once: padded reads of unused slots are masked out, but must not be NaN.
        """
        shape = (2, self.hf_config.num_hidden_layers, num_blocks, self.block_size,
                 self.kv_heads_per_rank, head_dim_of(self.hf_config))
        if self.device.type == "cpu":
            kv_cache = _lazily_zeroed_cpu_tensor(shape, self.dtype)
        else:
            kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.bind_kv_cache(kv_cache[0, i], kv_cache[1, i])
        return kv_cache

    def _unbind_kv_cache(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(empty, empty)


def _lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor over an anonymous memory map: the OS hands out zero pages on first
    touch, so a cache of several GiB costs no start-up time and only the memory its used blocks
    take. The tensor keeps the map alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
