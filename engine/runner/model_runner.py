"""The model runner: the data plane of one tensor-parallel rank.

It loads the model (config, weights, dtype, device), sizes and allocates the paged KV cache and
executes one ``ModelInput`` per step, returning float32 logits for the rows the scheduler asked
for. ``prepare_inputs`` turns a step's lists into device tensors and attention metadata for an
eager pass; on CUDA, decode steps replay captured graphs instead (``engine/runner/cuda_graphs.py``).

On CUDA a step's inputs go to the device from pinned host memory without blocking, and nothing
in a step waits for the device: the one read-back is the sampler's, of the sampled tokens. Block
tables persist in the runner between steps (``model_input.BlockTableArray``); a step brings only
its sequences' rows and new blocks, and the one int32 array cut from it serves every reader. On
CUDA the KV cache gets what is left once a warm-up has measured the largest step, a full-size
sampler pass and the decode graphs' memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import threading

import torch

from kvserve.engine.config import EngineConfig, resolve_max_model_len, resolve_max_num_batched_tokens
from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import (
    create_attention_backend,
    to_device,
)
from kvserve.engine.layers.cpu_matmul import compute_rows_alike, pack_model_weights
from kvserve.engine.layers.embed_head import ParallelLMHead
from kvserve.engine.layers.gguf_linear import GGUFWeight, weight_formats
from kvserve.engine.layers.linear import LinearBase
from kvserve.engine.layers.moe import FusedExperts
from kvserve.engine.layers.quantization import quantize_model
from kvserve.engine.model_input import (
    BlockTableArray,
    ModelInput,
    block_table_width,
    blocks_for,
    synthetic_input,
)
from kvserve.engine.model_loader.loader import load_hf_config, load_weights, resolve_device, resolve_dtype
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.models import build_model
from kvserve.engine.models.llama import head_dim_of
from kvserve.engine.models.registry import model_class_for
from kvserve.engine.process.malloc import tune_malloc
from kvserve.engine.process.threads import intra_op_threads
from kvserve.engine.runner.cuda_graphs import (
    CudaGraphRunner,
    Recorder,
    decode_graphs_enabled,
    decode_inputs,
    decode_metadata,
    record_cuda_graph,
)
from kvserve.engine.runner.kv_groups import GroupTables, bind_groups, model_kv_groups
from kvserve.engine.runner.state_cache import create_state_cache
from kvserve.engine.runner.step_inputs import prepare_inputs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Sequence
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS, PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels

log = logging.getLogger("kvserve.engine.runner.model_runner")

GiB = 1 << 30
# the warm-up's sampler pass turns every stage on, so that its buffers are at their largest
WARM_UP_SAMPLING = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                                  presence_penalty=0.1, frequency_penalty=0.1, logprobs=5, max_tokens=1)


def flush_denormals(device: torch.device) -> None:
    """Treat denormal floats as zero on CPU. The dequantized weights hold a few, and x86 handles
    denormals in microcode: measured here, a float32 decode step ran up to 10x slower with them.
    It is set in the stepping thread, and once per (thread, team size) in the OpenMP threads that
    thread runs (new threads inherit it; a pool made earlier does not): a row's result must not
    depend on which thread computed it."""
    if device.type == "cpu":
        torch.set_flush_denormal(True)
        team = (threading.get_ident(), torch.get_num_threads())
        if team not in _SHARED_FP_MODE and (kernels := load_kernels()) is not None:
            kernels.share_fp_mode(team[1])
            _SHARED_FP_MODE.add(team)


_SHARED_FP_MODE: set[tuple[int, int]] = set()  # teams whose threads flush denormals (flush_denormals)


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
        self.max_model_len = resolve_max_model_len(config, self.hf_config)
        self.device = self._pick_device()
        # the engine resolves it before it starts its runners; a runner made on its own does the same
        self.max_num_batched_tokens = resolve_max_num_batched_tokens(config)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self._threads_before = torch.get_num_threads()
        if self.device.type == "cpu":
            local_ranks = config.tensor_parallel_size // config.nnodes
            torch.set_num_threads(intra_op_threads(config.threads, local_ranks))
            tune_malloc()  # activations reuse heap pages instead of faulting in fresh ones
        flush_denormals(self.device)
        self.block_size = config.block_size
        self.graphs: CudaGraphRunner | None = None
        needs = getattr(model_class_for(self.hf_config), "attention_needs", frozenset())  # gpt-oss: sinks
        self.backend = create_attention_backend(config.attention_backend, self.device, config.block_size,
                                                self.dtype, config.kv_cache_dtype, needs)
        self.cache_dtype = self.backend.cache_dtype(self.dtype)
        self.attention_backend_name = self.backend.name
        self.model = build_model(self.hf_config, self.dtype, self.device, self.parallel, self.backend)
        self.kv_groups = model_kv_groups(self.model.attention_layers())  # by each layer's window
        load_weights(self.model, self.source, show_progress=self.parallel.rank == 0,  # one bar, not N
                     gguf_blocks=self.device.type == "cpu" and config.quantization is None)
        if config.quantization is not None:
            quantize_model(self.model, config.quantization, self.device)
        self.weight_formats = weight_formats(self.model)  # ModelInfo's: what each weight is multiplied in
        # a verification row computed as a plain decode of it, bit for bit (``RowsAlike``)
        self.rows_alike = compute_rows_alike(self.model) if config.speculative != "off" else None
        # bf16 on the CPU: oneDNN's blocked copies, within the memory the KV cache and the other
        # local ranks leave
        kv_budget = int(config.kv_cache_memory * GiB) if self.device.type == "cpu" else 0
        packed = pack_model_weights(self.model, kv_budget, config.tensor_parallel_size // config.nnodes)
        if packed:
            log.info("bfloat16 weights packed for oneDNN: %.0f MiB of blocked copies", packed / 2**20)
        self.vocab_size = self.hf_config.vocab_size
        width = block_table_width(self.max_model_len, self.block_size)
        self.block_tables = BlockTableArray(config.max_num_seqs, width)  # changed by each step's updates
        self.group_tables = GroupTables(self.kv_groups, config.max_num_seqs, width)  # the other groups'
        # before the KV blocks: it takes from their memory
        # (with a scratch row that decode graphs pad batches with)
        graphs = decode_graphs_enabled(config.enforce_eager, self.backend.name, self.device,
                                       test_recorder=record_graph is not None)
        self.state_cache = create_state_cache(self.model, self.config, self.dtype, self.device,
                                              scratch_row=graphs)
        self.num_kv_blocks = self.parallel.min_over_ranks(self._count_kv_blocks(record_graph))
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.graphs = self._new_graph_runner(record_graph)
        if self.graphs is not None:
            self.graphs.capture()

    # -- execution -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> torch.Tensor | None:
        """float32 logits [len(inp.logits_indices), vocab] (None on ranks other than 0)."""
        flush_denormals(self.device)  # per thread: the engine may step from another thread
        if self.rows_alike is not None:
            self.rows_alike.set(inp.is_decode_only)
        views = self.group_tables.views(inp, self.block_size)  # (first: the other groups' updates)
        if inp.state_rollbacks:  # verifications that rejected drafts: their states cut back first
            self.state_cache.roll_back(inp.state_rollbacks)
        if inp.state_copies:  # forked choices take their parent's state
            self.state_cache.copy(inp.state_copies)
        if inp.seq_rows:  # the step's block tables, cut from this runner's persistent array
            inp.block_table_array = self.block_tables.take(inp, self.block_size)
        if self.graphs is not None and self.graphs.fits(inp):
            slots = None if self.state_cache is None else self.state_cache.step_slots(inp.state_slots,
                                                                                      inp.num_seqs)
            hidden = self.graphs.replay(decode_inputs(inp, pin=self.device.type == "cuda", state_slots=slots))
            logits_indices = to_device(inp.logits_indices, self.device)
        else:
            batch = prepare_inputs(inp, self.backend, self.device, views)
            if self.state_cache is not None:
                batch.attn_metadata.state_slots = self.state_cache.step_slots(inp.state_slots, inp.num_seqs)
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
        torch.set_num_threads(self._threads_before)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- set-up --------------------------------------------------------------------------
    def _new_graph_runner(self, record_graph: Recorder | None) -> CudaGraphRunner | None:
        """A decode-graph runner over the bound KV cache (nothing captured yet), or None where
        decode runs eagerly."""
        if not decode_graphs_enabled(self.config.enforce_eager, self.backend.name, self.device,
                                     test_recorder=record_graph is not None):
            return None
        if self.kv_groups.num_groups > 1:  # graphs hold one group's tables
            log.info("KV cache groups %s: decode steps run eagerly", self.kv_groups.windows)
            return None
        return CudaGraphRunner(
            self.model, lambda inputs: decode_metadata(inputs, self.block_size), self.config.max_num_seqs,
            self.max_model_len, self.block_size, self.device, record=record_graph or record_cuda_graph,
            state_pad_row=None if self.state_cache is None else self.state_cache.pad_row,
        )  # fmt: skip

    def _pick_device(self) -> torch.device:
        device = resolve_device(self.config.device)
        if device.type == "cuda":
            device = torch.device("cuda", self.parallel.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        return device

    @property
    def kv_heads_per_rank(self) -> int:
        return self.model.attention_layers()[0].impl.num_kv_heads

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes: K and V, ``block_size`` tokens, in each layer of a KV cache group
        (every layer with one group; in the backend's layout and cache dtype: an int8 cache's rows
        carry their scales)."""
        layer_block = self.backend.kv_cache_shape(1, self.kv_heads_per_rank, head_dim_of(self.hf_config))
        one_block = math.prod(layer_block)
        return 2 * self.kv_groups.num_slots * one_block * self.cache_dtype.itemsize

    def exact_rows(self) -> int | None:
        """How many decode rows a step may hold and still compute each row as alone (what
        speculation's verification relies on): any (None) on a GPU, where speculation agrees up to
        near ties, and on the CPU where every projection and the LM head multiply in csrc/gemm.c
        (packed bfloat16: a row's sums run in one order at any count; no mixture of experts), as far
        as the GGUF block kernels keep them alike (``GGUFWeight.alike_rows``: at any count where the
        int8 GEMM's rows are the dots' bits); else MAX_FUSED_ROWS,
        the rows the fused decode step and the row kernel (``RowsAlike``) take."""
        if self.device.type != "cpu":
            return None
        modules = list(self.model.modules())
        linears = [m for m in modules if isinstance(m, LinearBase | ParallelLMHead)]
        if not linears or any(isinstance(m, FusedExperts) for m in modules):
            return MAX_FUSED_ROWS
        limits = []
        for m in linears:
            if isinstance(m.quantized, GGUFWeight):
                alike = m.quantized.alike_rows(self.dtype)
                limits += [] if alike is None else [alike]
            elif m.quantized is not None or not isinstance(m.packed, PackedWeight):
                return MAX_FUSED_ROWS
        return min(limits, default=None)

    def _count_kv_blocks(self, record_graph: Recorder | None) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            budget = self._free_gpu_bytes_after_warm_up(record_graph)
        else:  # the state slots' memory is part of kv_cache_memory (on CUDA, in use already)
            budget = int(self.config.kv_cache_memory * GiB) - self.state_cache_bytes
        blocks = budget // self.kv_block_bytes
        if blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache: one block needs {self.kv_block_bytes} bytes; "
                "raise kv_cache_memory / gpu_memory_utilization or set num_kv_blocks"
            )
        return blocks

    @property
    def num_state_slots(self) -> int:
        return 0 if self.state_cache is None else self.state_cache.num_slots

    @property
    def num_state_snapshots(self) -> int:
        return 0 if self.state_cache is None else self.state_cache.num_snapshots

    @property
    def state_cache_bytes(self) -> int:
        return 0 if self.state_cache is None else self.state_cache.nbytes

    def _free_gpu_bytes_after_warm_up(self, record_graph: Recorder | None) -> int:
        """GPU memory for the KV cache: what ``gpu_memory_utilization`` allows, less what is in use,
        less the peak of the largest step (its activations, then a sampler pass over
        ``max_num_seqs`` rows), less what the decode graphs will take. Measured over a scratch KV
        cache just big enough for that step."""
        warm_up = self._warm_up_input()
        scratch = self._allocate_kv_cache(sum(len(table) for table in warm_up.block_tables))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.execute_model(warm_up)
        self.sample_full_batch()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        graphs = self._graph_memory_reserve(record_graph)
        self._unbind_kv_cache()
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        log.info("KV cache sizing: %.2f GiB for the largest step, %.2f GiB reserved for decode graphs",
                 activations / GiB, graphs / GiB)
        return int(total * self.config.gpu_memory_utilization - (total - free) - activations - graphs)

    @torch.inference_mode()
    def sample_full_batch(self) -> None:
        """The largest sampler pass a step can ask for: logits of ``max_num_seqs`` rows through the
        LM head, then every sampling stage (penalties, top-k/p, min-p, seeded and unseeded draws,
        logprobs). Only rank 0 samples; the other ranks have no logits."""
        from kvserve.engine.layers.sampler import Sampler

        rows = self.config.max_num_seqs
        hidden = torch.zeros(rows, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return
        prompt = list(range(min(64, self.vocab_size)))
        params = [dataclasses.replace(WARM_UP_SAMPLING, seed=i if i % 2 else None) for i in range(rows)]
        seqs = [Sequence(f"warm-up-{i}", prompt, p) for i, p in enumerate(params)]
        Sampler(self.vocab_size, [])(logits.float(), seqs)

    def _graph_memory_reserve(self, record_graph: Recorder | None) -> int:
        """Device memory the decode graphs will take, measured by capturing, over the bound scratch
        cache, the largest size (which sets the shared pool, the capture stream's cuBLAS workspace
        and the graphs' output buffer) and then the smallest (what each further graph adds);
        the graphs are then dropped and captured for real once the KV cache exists."""
        graphs = self._new_graph_runner(record_graph)
        if graphs is None:
            return 0
        free = lambda: (torch.cuda.synchronize(self.device), torch.cuda.mem_get_info(self.device)[0])[1]
        before = free()
        graphs.capture(graphs.sizes[-1:])
        after_largest = free()
        per_graph = 0
        if len(graphs.sizes) > 1:
            graphs.capture(graphs.sizes[:1])
            per_graph = max(0, after_largest - free())
        graphs.close()
        torch.cuda.empty_cache()
        return max(0, before - after_largest) + per_graph * (len(graphs.sizes) - 1)

    def _warm_up_input(self) -> ModelInput:
        """The largest prefill one step can hold: ``max_num_batched_tokens`` tokens in sequences
        of at most ``max_model_len``, with blocks numbered from 0."""
        max_len, tokens = self.max_model_len, self.max_num_batched_tokens
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        lens = lens[: self.config.max_num_seqs]
        tables, next_block = [], 0
        for n in lens:
            tables.append(list(range(next_block, next_block + blocks_for(n, self.block_size))))
            next_block += len(tables[-1])
        return synthetic_input([(0, n) for n in lens], tables, self.block_size)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor [2, slots, *per-layer shape] (slots: the layers of a KV cache group, every
        layer with one group); each layer gets views of its slot. The per-layer shape is the
        backend's (``kv_cache_shape``): each backend reads the cache in its own layout.

        Zeroed once: padded reads of unused slots are masked out, but must not be NaN.
        """
        head_dim = head_dim_of(self.hf_config)
        layer_shape = self.backend.kv_cache_shape(num_blocks, self.kv_heads_per_rank, head_dim)
        shape = (2, self.kv_groups.num_slots, *layer_shape)
        if self.device.type == "cpu":
            kv_cache = _lazily_zeroed_cpu_tensor(shape, self.cache_dtype)
        else:
            kv_cache = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        bind_groups(self.model.attention_layers(), self.kv_groups, kv_cache)
        return kv_cache

    def _unbind_kv_cache(self) -> None:
        empty = torch.empty(0, dtype=self.cache_dtype, device=self.device)
        for layer in self.model.attention_layers():
            layer.bind_kv_cache(empty, empty)


def _lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor over an anonymous memory map: the OS hands out zero pages on first
    touch, so a cache of several GiB costs no start-up time and only the memory its used blocks
    take. The tensor keeps the map alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
