"""A GGUF model as loaded and run. What it holds after loading, counted in bytes (issue 48:
resident memory at most ~1.3x the file): a random Q4_K_M-shaped file (Q4_K projections, Q6_K
v/down and tied embedding table, float32 norms, as llama-quantize writes them) loaded by the
runner; every tensor its modules reach (parameters, buffers, GGUF parts, packed copies, the
embedding table), overlapping views counted once, against the bytes of the file's tensors. Where
they lie is also checked: the block tensors in the file's mapping, not in copies. A prefill
product's extra memory: one dequantized panel at a time, never the whole weight. And the fused
decode step multiplying the blocks as the per-op path does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from kvserve.benchmarks.scale.kernels import random_weight
from kvserve.benchmarks.scale.prefill import write_model
from kvserve.engine.config import EngineConfig
from kvserve.engine.layers import gguf_linear
from kvserve.engine.layers.gguf_linear import PANEL_FROM_ROWS, PANEL_ROWS, GGUFTensor, GGUFWeight
from kvserve.engine.model_input import ModelInput
from kvserve.engine.models.decode_row import DecodeRow
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.kernels.cpu.bindings import CpuKernels, load_kernels
from kvserve.kernels.cpu.kquant import BLOCK_TYPES, REPACKED, X16_SUPER, kquant_kernels

pytestmark = pytest.mark.skipif(kquant_kernels() is None, reason="the CPU kernels are not built here")

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 512, 1536, 8, 4, 3, 4096
def write_q4_k_m(path) -> None:
    """llama-quantize's Q4_K_M types: Q6_K for v and down (in these layers) and the tied table, Q4_K
    elsewhere (benchmarks/scale/prefill.py writes it)."""
    write_model(path, LAYERS, 256, HIDDEN, INTER, HEADS, KV_HEADS, VOCAB)


def reached_tensors(value, seen: set[int], out: list[torch.Tensor]) -> None:
    """Every tensor in ``value``: a tensor, a dataclass, named tuple, list, tuple or dict of them."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            reached_tensors(getattr(value, f.name), seen, out)
    elif isinstance(value, list | tuple):
        for v in value:
            reached_tensors(v, seen, out)
    elif isinstance(value, dict):
        for v in value.values():
            reached_tensors(v, seen, out)


def held_spans(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The address ranges of every tensor the model's modules hold, merged where they overlap."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        for value in vars(module).values():
            reached_tensors(value, seen, tensors)
    spans = []
    for t in tensors:
        if t.numel() == 0 or t.device.type != "cpu":
            continue
        extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1
        spans.append((t.data_ptr(), t.data_ptr() + extent * t.element_size()))
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def mapping_resident(path) -> int:
    """Bytes of the file's mapping resident in this process (/proc/self/smaps' Rss)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = line.rstrip().endswith(str(path))
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def file_mapping(path) -> list[tuple[int, int]]:
    with open("/proc/self/maps") as f:
        lines = [line.split()[0] for line in f if line.rstrip().endswith(str(path))]
    return [tuple(int(a, 16) for a in m.split("-")) for m in lines]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_q4_k_m_model_holds_at_most_1_3x_its_files_tensor_bytes(tmp_path, dtype):
    path = tmp_path / "model-Q4_K_M.gguf"
    write_q4_k_m(path)
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    runner = ModelRunner(EngineConfig(model=str(path), dtype=dtype, num_kv_blocks=8, enforce_eager=True))
    spans = held_spans(runner.model)
    held = sum(hi - lo for lo, hi in spans)
    mapped = file_mapping(path)
    in_file = sum(hi - lo for lo, hi in spans if any(a <= lo < b for a, b in mapped))
    # each repacked part's bytes, and its bytes as the file stores them
    stored = {x16: 16 * BLOCK_TYPES[t][1] for t, x16 in REPACKED.items()}
    parts = [p for m in runner.model.modules() if isinstance(getattr(m, "quantized", None), GGUFWeight)
             for _, p in m.quantized.parts if isinstance(p, GGUFTensor) and p.ggml_type in X16_SUPER]
    repacked = sum(p.data.numel() for p in parts)
    repacked_stored = sum(p.data.numel() * stored[p.ggml_type] // X16_SUPER[p.ggml_type] for p in parts)
    resident = mapping_resident(path)
    embed = runner.model.model.embed_tokens
    vocab = embed.vocab_end - embed.vocab_start
    embed.lookup(torch.randint(0, vocab, (4 * vocab,), generator=torch.Generator().manual_seed(0)))
    looked_up = mapping_resident(path) - resident
    table_repacked = embed.table.ggml_type in X16_SUPER
    runner.shutdown()
    # the layers' block tensors are views of the mapping, or (Q4_K and Q6_K on AVX512-VNNI builds,
    # not in float32) repacked copies; the other copies are llama's q and k rows (reordered for
    # rotate-half rotary) and the float norms. Held in memory: the copies, and the mapping's pages
    # resident (a tied table's view stays for the embedding's lookups beside the head's repacked
    # copy, its pages handed back but for the rows looked up)
    copies = held - in_file
    assert copies + resident <= 1.3 * file_bytes, (copies, resident, file_bytes, in_file, repacked)
    assert in_file + repacked >= 0.6 * file_bytes, (held, file_bytes, in_file, repacked)
    assert (repacked > 0) == (dtype == "bfloat16" and kquant_kernels().isa == 512)
    # a repacked tensor's pages of the file, read once to repack it, are handed back: what stays
    # resident of the mapping is at most the rest of the file
    assert resident <= file_bytes - 0.9 * repacked_stored + (1 << 20), (resident, file_bytes, repacked_stored)
    # the tied table repacked for the LM head: the embedding looks its rows up in that copy, so no
    # lookup brings the file's table back (from the mapping, each fault maps the cached pages around)
    assert table_repacked == (repacked > 0)
    if table_repacked:
        assert looked_up == 0, looked_up


def test_a_prefill_product_dequantizes_one_panel_at_a_time(monkeypatch):
    """Where a type takes dequantized panels (a type without the int8 GEMM on an AVX512-BF16 CPU:
    here forced) a product holds one panel's floats at a time; where it takes the GEMM, none."""
    original_takes = gguf_linear.gemm_takes
    monkeypatch.setattr(gguf_linear, "gemm_takes", lambda kernels, part: False)
    monkeypatch.setattr(kquant_kernels(), "dots_over_panels", lambda ggml_type: False)
    n_out, k = 5 * PANEL_ROWS + 16, 512
    part = GGUFTensor(random_weight(int(T.Q4_K), n_out, k, 7), int(T.Q4_K), (n_out, k))
    weight = GGUFWeight(((0, part),), n_out, k)
    dequantized: list[int] = []
    original = GGUFTensor.dequantize

    def counted(self, dtype, ids=None):
        dequantized.append(self.data.shape[0])
        return original(self, dtype, ids)

    monkeypatch.setattr(gguf_linear.GGUFTensor, "dequantize", counted)
    x = torch.randn(PANEL_FROM_ROWS, k).to(torch.bfloat16)
    y = weight.linear(x)
    assert dequantized == [PANEL_ROWS] * 5 + [16]
    monkeypatch.undo()
    monkeypatch.setattr(gguf_linear.GGUFTensor, "dequantize", counted)
    dequantized.clear()
    y_gemm = weight.linear(x)
    kernels = kquant_kernels()
    int8 = original_takes(kernels, part) or kernels.dots_over_panels(part.ggml_type)
    assert dequantized == ([] if int8 else [PANEL_ROWS] * 5 + [16])
    monkeypatch.undo()
    dense = part.dequantize(torch.float32).double()
    want = x.double() @ dense.T
    assert (y.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    # the GEMM's int8 activations: within 2^-5 of each output's sum of |products| (test_gguf_linear.py)
    assert ((y_gemm.double() - want).abs() <= 2 ** -5 * (x.double().abs() @ dense.abs().T)).all()


TABLE = [list(range(8))]  # one sequence in KV blocks 0-7


def decode_logits(runner: ModelRunner, prompt: list[int], steps: int) -> torch.Tensor:
    """The prompt's prefill, then ``steps`` greedy decode steps of one row: each step's logits."""
    n = len(prompt)
    every = list(range(n))
    logits = runner.execute_model(ModelInput(input_ids=prompt, positions=every, query_lens=[n],
                                             context_lens=[n], block_tables=TABLE, slot_mapping=every,
                                             logits_indices=[n - 1]))
    out = []
    for pos in range(n, n + steps):
        token = int(logits[-1].argmax())
        logits = runner.execute_model(ModelInput(
            input_ids=[token], positions=[pos], query_lens=[1], context_lens=[pos + 1], block_tables=TABLE,
            slot_mapping=[pos], logits_indices=[0]))
        out.append(logits[-1].float())
    return torch.stack(out)


@pytest.mark.skipif(kquant_kernels() is None or kquant_kernels().isa == 0 or not load_kernels().fused_rows,
                    reason="the fused decode step and the vector dots are built for x86 CPUs")
def test_the_fused_decode_step_multiplies_gguf_weights_as_the_per_op_path(tmp_path, monkeypatch):
    """bfloat16: a Q4_K_M model's decode steps run in the fused step (csrc/decode_row.c, the block
    dots on the same quantized rows) and give the per-op path's logits."""
    path = tmp_path / "model-Q4_K_M.gguf"
    write_q4_k_m(path)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=8, enforce_eager=True))
    model = runner.model.model
    assert DecodeRow.fits(model)
    calls: list[bool] = []
    real = CpuKernels.decode_row
    monkeypatch.setattr(CpuKernels, "decode_row", lambda self, *a: calls.append(real(self, *a)) or calls[-1])
    prompt = [5, 17, 250, 3, 99, 42, 7]
    model._decode_row = DecodeRow(model)
    fused = decode_logits(runner, prompt, 6)
    assert calls == [True] * 6
    model._decode_row = None
    per_op = decode_logits(runner, prompt, 6)
    runner.shutdown()
    assert len(calls) == 6
    assert torch.equal(fused.argmax(-1), per_op.argmax(-1))
    assert (fused - per_op).abs().max() <= 1e-5 * per_op.abs().max(), (fused - per_op).abs().max()


def test_a_prefill_chunk_through_the_int8_gemm_gives_the_block_dots_logits(tmp_path, monkeypatch):
    """A 128-token prompt (PANEL_FROM_ROWS rows: every K-quant projection takes the int8 GEMM where
    this CPU class has it) through the Q4_K_M-shaped model: its last row's logits against the same
    prefill by the block dots (the same quantized activations and integer sums, other float sums:
    measured cosine 0.99985) and by float32 serving (the stored weights' exact products: the int8
    activations' rounding, compounded over 3 layers, measured cosine 0.9962, as the dots' 0.9960)."""
    path = tmp_path / "model-Q4_K_M.gguf"
    write_q4_k_m(path)
    kernels = kquant_kernels()
    taken: list[int] = []
    real_gemm = type(kernels).gemm

    def counted(self, weight, ggml_type, *args, **kwargs):
        taken.append(ggml_type)
        return real_gemm(self, weight, ggml_type, *args, **kwargs)

    monkeypatch.setattr(type(kernels), "gemm", counted)
    prompt = torch.randint(0, VOCAB, (PANEL_FROM_ROWS,), generator=torch.Generator().manual_seed(5)).tolist()
    n, table = len(prompt), [list(range(PANEL_FROM_ROWS // 16))]
    step = ModelInput(input_ids=prompt, positions=list(range(n)), query_lens=[n], context_lens=[n],
                      block_tables=table, slot_mapping=list(range(n)), logits_indices=[n - 1])
    runners = {dtype: ModelRunner(EngineConfig(model=str(path), dtype=dtype, num_kv_blocks=len(table[0]),
                                               enforce_eager=True)) for dtype in ("bfloat16", "float32")}
    got = runners["bfloat16"].execute_model(step)[-1].double()
    exact = runners["float32"].execute_model(step)[-1].double()
    monkeypatch.setattr(gguf_linear, "gemm_takes", lambda kernels, part: False)
    monkeypatch.setattr(kernels, "dots_over_panels", lambda ggml_type: True)
    dots = runners["bfloat16"].execute_model(step)[-1].double()

    def cosine(a, b):
        return torch.nn.functional.cosine_similarity(a, b, dim=0).item()

    if kernels.isa:  # q, k, o, gate, up in Q4_K (repacked on AVX512-VNNI) and v, down in Q6_K, each layer
        types = [REPACKED.get(int(t), int(t)) if kernels.isa == 512 else int(t) for t in (T.Q4_K, T.Q6_K)]
        assert sorted(set(taken)) == sorted(types) and len(taken) == 7 * LAYERS
        assert cosine(got, dots) > 0.9995
        if kernels.gemm_alike(int(T.Q4_K)) and kernels.gemm_alike(int(T.Q6_K)):
            assert torch.equal(got, dots)  # the GEMM's rows are the dots' bits
    assert cosine(got, exact) > 0.99


def test_a_decode_row_beside_a_prefill_chunk_in_the_gemm_gives_its_logits_alone(tmp_path):
    """What speculation's verification needs of a step (``ModelRunner.exact_rows``): a decode row's
    logits the same bits whether it runs alone or in one step with another sequence's prefill
    chunk of 40 rows, whose products take the int8 GEMM (``GEMM_FROM_ROWS``) where its K-quant rows
    are the dots' bits; then the runner answers rows alike at any count (None)."""
    path = tmp_path / "model-Q4_K_M.gguf"
    write_q4_k_m(path)
    runner = ModelRunner(EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=8, enforce_eager=True))
    kernels = kquant_kernels()
    alike = kernels.isa != 0 and all(kernels.gemm_alike(int(t)) for t in (T.Q4_K, T.Q6_K))
    assert runner.exact_rows() == (None if alike else PANEL_FROM_ROWS - 1)
    a = [5, 17, 250, 3, 99, 42, 7, 11, 300, 12]
    b = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    n = len(a)
    runner.execute_model(ModelInput(input_ids=a, positions=list(range(n)), query_lens=[n], context_lens=[n],
                                    block_tables=[[0]], slot_mapping=list(range(n)), logits_indices=[n - 1]))
    alone = runner.execute_model(ModelInput(input_ids=[8], positions=[n], query_lens=[1],
                                            context_lens=[n + 1], block_tables=[[0]], slot_mapping=[n],
                                            logits_indices=[0]))[0]
    both = runner.execute_model(ModelInput(
        input_ids=[8] + b, positions=[n] + list(range(len(b))), query_lens=[1, len(b)],
        context_lens=[n + 1, len(b)], block_tables=[[0], [1, 2, 3]],
        slot_mapping=[n] + list(range(16, 16 + len(b))), logits_indices=[0, len(b)]))
    runner.shutdown()
    assert both.shape[0] == 2
    if alike:
        assert torch.equal(alone, both[0])
    assert (alone - both[0]).abs().max() <= 1e-2 * alone.abs().max()


@pytest.mark.skipif(kquant_kernels() is None or kquant_kernels().isa != 512,
                    reason="Q4_K is repacked on AVX512-VNNI builds only")
def test_repacked_q4_k_gives_the_stored_blocks_bits(tmp_path, monkeypatch):
    """The Q4_K projections repacked at load (``REPACKED``, the default) against the same file kept as
    stored (``KVSERVE_GGUF_REPACK=0``: the block dots and per-step panels), in bfloat16: a 40-token
    prefill (the int8 GEMM) and 4 decode steps (one row: the dots against the repacked tiles; the
    fused decode step where built) give the same logits, bit for bit."""
    path = tmp_path / "model-Q4_K_M.gguf"
    write_q4_k_m(path)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(9)).tolist()

    def logits(repack: str) -> torch.Tensor:
        monkeypatch.setenv(gguf_linear.REPACK_SWITCH, repack)
        config = EngineConfig(model=str(path), dtype="bfloat16", num_kv_blocks=8, enforce_eager=True)
        runner = ModelRunner(config)
        formats = runner.weight_formats
        out = decode_logits(runner, prompt, 4)
        runner.shutdown()
        assert ("o_proj=Q4_K_X16" in formats) == (repack == "1"), formats
        return out

    assert torch.equal(logits("1"), logits("0"))
