"""GGUF block formats kept as stored (engine/layers/gguf_linear.py, the loader's ``keep_blocks``): a
tiny random Llama written with the ``gguf`` package's writer in K-quants (random valid blocks),
loaded by the runner, greedy-decodes the tokens of the same weights dequantized to float32 (a
second file of F32 tensors) up to the first near-tie; the layers hold views of the mapped file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from kvserve.engine.config import EngineConfig
from kvserve.engine.layers.gguf_linear import (
    GEMM_FROM_ROWS,
    PANEL_FROM_ROWS,
    GGUFTensor,
    GGUFWeight,
    gemm_from_rows,
    gemm_takes,
)
from kvserve.engine.model_input import ModelInput
from kvserve.engine.runner.model_runner import ModelRunner
from kvserve.kernels.cpu.kquant import BLOCK_TYPES, kquant_kernels

pytestmark = pytest.mark.skipif(kquant_kernels() is None, reason="the CPU kernels are not built here")

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 384
# where each type's float16 scales sit in a block, and their spread for weights of std ~0.05
SCALES = {T.Q4_0: ((0,), 1e-2), T.Q8_0: ((0,), 7e-4), T.Q4_K: ((0, 2), 1.5e-4), T.Q5_K: ((0, 2), 7.5e-5),
          T.Q6_K: ((208,), 3.7e-5)}
# a Q4_K_M-like mix, plus Q5_K, Q8_0, Q4_0 and a Q5_0 tensor (a type kept as floats: a dense part)
LAYER_TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q5_0, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
               "ffn_gate": T.Q5_K, "ffn_up": T.Q8_0, "ffn_down": T.Q4_0}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, row bytes]: random bytes with random finite float16 scales written in."""
    values, size = BLOCK_TYPES[int(qtype)]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    offsets, spread = SCALES[qtype]
    for at in offsets:
        halves = (rng.standard_normal(len(blocks)) * spread).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def tensors(tied: bool, seed: int = 0) -> list[tuple[str, np.ndarray, T]]:
    """(GGUF name, data, type): uint8 blocks for block types, float32 values otherwise."""
    rng = np.random.default_rng(seed)

    def weight(name, qtype, rows, cols):
        if qtype == T.Q5_0:
            return name, quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype), qtype
        return name, random_blocks(qtype, rows, cols, rng), qtype

    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    out = [weight("token_embd.weight", T.Q8_0 if tied else T.Q4_K, VOCAB, HIDDEN)]
    if not tied:
        out.append(weight("output.weight", T.Q6_K, VOCAB, HIDDEN))
    out.append(("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), T.F32))
    for i in range(LAYERS):
        for part, qtype in LAYER_TYPES.items():
            out.append(weight(f"blk.{i}.{part}.weight", qtype, *shapes[part]))
        for norm in ("attn_norm", "ffn_norm"):
            out.append((f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32), T.F32))
    return out


def write_gguf(path, items, as_float32: bool) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    for name, data, qtype in items:
        if as_float32 and qtype != T.F32:
            writer.add_tensor(name, dequantize(data, qtype).astype(np.float32))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


TABLE = [list(range(8))]  # one sequence in KV blocks 0-7


def prompt_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    n = len(prompt)
    every = list(range(n))
    return runner.execute_model(ModelInput(input_ids=prompt, positions=every, query_lens=[n],
                                           context_lens=[n], block_tables=TABLE, slot_mapping=every,
                                           logits_indices=every))


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after ``prompt`` and each choice's margin over the runner-up."""
    logits = prompt_logits(runner, prompt)[-1:]
    tokens, margins = [], []
    for _ in range(steps):
        top = logits[0].topk(2).values
        tokens.append(int(logits[0].argmax()))
        margins.append(float(top[0] - top[1]))
        pos = len(prompt) + len(tokens) - 1
        logits = runner.execute_model(ModelInput(
            input_ids=[tokens[-1]], positions=[pos], query_lens=[1], context_lens=[pos + 1],
            block_tables=TABLE, slot_mapping=[pos], logits_indices=[0]))
    return tokens, margins


def runner_for(path, dtype: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), dtype=dtype, num_kv_blocks=8, enforce_eager=True))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_the_dequantized_weights_up_to_the_first_near_tie(tmp_path, tied, dtype):
    items = tensors(tied, seed=2 if tied else 3)  # seeds whose greedy runs are not near-tied at once
    write_gguf(tmp_path / "blocks.gguf", items, as_float32=False)
    write_gguf(tmp_path / "f32.gguf", items, as_float32=True)
    prompt = [5, 17, 250, 3, 99, 42, 7, 7, 1, 0, 123, 64, 31]
    reference = runner_for(tmp_path / "f32.gguf", "float32")
    want_logits = prompt_logits(reference, prompt)
    want, margins = greedy(reference, prompt, 40)
    reference.shutdown()
    runner = runner_for(tmp_path / "blocks.gguf", dtype)
    # how far the activations' int8 rounding (and bfloat16) moves the logits: their RMS change on
    # the prompt (about 0.6% of each product; the random model amplifies it through its layers)
    moved = (prompt_logits(runner, prompt) - want_logits).pow(2).mean().sqrt().item()
    assert moved < 0.05 * want_logits.abs().max()
    got, _ = greedy(runner, prompt, 40)
    layer = runner.model.model.layers[0]
    qkv, down = layer.self_attn.qkv_proj.quantized, layer.mlp.down_proj.quantized
    # Q4_K and Q6_K projections (and LM head) are repacked for the int8 kernels where they run them
    # (AVX512-VNNI builds, not float32)
    x16 = "_X16" if dtype == "bfloat16" and kquant_kernels().isa == 512 else ""
    assert isinstance(qkv, GGUFWeight) and qkv.formats() == [f"Q4_K{x16}", dtype, f"Q6_K{x16}"]
    assert down.formats() == ["Q4_0"] and layer.mlp.gate_up_proj.quantized.formats() == ["Q5_K", "Q8_0"]
    assert layer.mlp.down_proj.weight.numel() == 0  # no float copy
    embed, head = runner.model.model.embed_tokens, runner.model.lm_head
    assert isinstance(embed.table, GGUFTensor)
    assert head.quantized.formats() == (["Q8_0"] if tied else [f"Q6_K{x16}"])
    assert runner.weight_formats == [  # ModelInfo's weight_formats
        "down_proj=Q4_0", f"embed_tokens={'Q8_0' if tied else 'Q4_K'}", "gate_up_proj=Q5_K,Q8_0",
        f"lm_head={'Q8_0' if tied else f'Q6_K{x16}'}", f"o_proj=Q4_K{x16}",
        f"qkv_proj=Q4_K{x16},Q6_K{x16},{dtype}"]
    runner.shutdown()
    # a near-tie: a runner-up within 4 times that RMS change of the reference's choice
    first_tie = next((i for i, m in enumerate(margins) if m < 4 * moved), len(margins))
    assert first_tie >= 8, (moved, margins)
    assert got[:first_tie] == want[:first_tie]


def test_block_tensors_are_views_of_the_mapped_file(tmp_path):
    """Kept as stored means no copy: the down projection's bytes lie in the file's mapping (the
    llama q and k rows, reordered for rotate-half rotary, are the one copy)."""
    items = tensors(tied=False)
    write_gguf(tmp_path / "blocks.gguf", items, as_float32=False)
    runner = runner_for(tmp_path / "blocks.gguf", "float32")
    layer = runner.model.model.layers[1]
    down = layer.mlp.down_proj.quantized.parts[0][1]
    stored = {name: data for name, data, _ in items}["blk.1.ffn_down.weight"]
    assert torch.equal(down.data, torch.from_numpy(stored))
    with open("/proc/self/maps") as f:
        maps = [line.split()[0] for line in f if line.rstrip().endswith(str(tmp_path / "blocks.gguf"))]
    spans = [tuple(int(a, 16) for a in m.split("-")) for m in maps]
    assert any(lo <= down.data.data_ptr() < hi for lo, hi in spans)
    runner.shutdown()


def test_model_info_reports_the_bundled_files_q8_0_table_as_stored_and_its_q4_1_projections_as_floats():
    """The bundled file: Q4_1 projections (a type the kernels do not take: dequantized at load) and
    a Q8_0 embedding, tied to the LM head (kept as stored)."""
    from kvserve.engine import LLM

    llm = LLM("default", dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    try:
        formats = llm.engine.model_info().weight_formats
    finally:
        llm.shutdown()
    assert formats == ["down_proj=bfloat16", "embed_tokens=Q8_0", "gate_up_proj=bfloat16", "lm_head=Q8_0",
                       "o_proj=bfloat16", "qkv_proj=bfloat16"]


def test_a_shard_that_splits_a_block_is_refused_with_the_block_size():
    weight = GGUFTensor(torch.zeros(4, 2 * 144, dtype=torch.uint8), 12, (4, 512))
    assert weight.narrow(1, 256, 256).data.shape == (4, 144)
    with pytest.raises(ValueError, match="Q4_K tensor of 512 inputs splits only at whole blocks of 256"):
        weight.narrow(1, 128, 256)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_prefill_rows_take_the_int8_gemm_or_dequantized_panels_and_decode_rows_the_block_dots(qtype):
    """bfloat16 products of PANEL_FROM_ROWS rows or more take the int8 GEMM where this CPU class
    does for the type (csrc/kquant_gemm.c), else dequantize panels into the float GEMM (AVX512-BF16)
    or take the int8 dots (other classes); fewer rows take the int8 dots (docs/design/gguf_kquants.md),
    except that types whose GEMM rows are the dots' bits (``gemm_alike``) take the GEMM from
    GEMM_FROM_ROWS. Against gguf's dequantize then a float64 matmul: the panels within bfloat16's
    rounding of the products, the int8 paths within the activations' int8 rounding too. The GEMM's
    products are the block dots' up to float sums, and bit for bit where alike."""
    rng = np.random.default_rng(int(qtype))
    n_out, k = 300, 512  # more output rows than one panel
    blocks = random_blocks(qtype, n_out, k, rng)
    part = GGUFTensor(torch.from_numpy(blocks), int(qtype), (n_out, k))
    weight = GGUFWeight(((0, part),), n_out, k)
    dense = torch.from_numpy(dequantize(blocks, qtype).reshape(n_out, k)).double()
    kernels = kquant_kernels()
    alike = kernels.gemm_alike(int(qtype))
    assert gemm_from_rows(kernels, part) == (GEMM_FROM_ROWS if alike else PANEL_FROM_ROWS)
    for rows in (GEMM_FROM_ROWS - 1, GEMM_FROM_ROWS, PANEL_FROM_ROWS - 1, PANEL_FROM_ROWS):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = x.double() @ dense.T
        taken = []
        real = type(kernels).gemm

        def counted(self, *args, _taken=taken, _real=real, **kwargs):
            _taken.append(True)
            return _real(self, *args, **kwargs)

        type(kernels).gemm = counted
        try:
            got = weight.linear(x).double()
        finally:
            type(kernels).gemm = real
        scale = (x.double().abs() @ dense.abs().T)  # the sum of |products| per output
        worst = ((got - want).abs() / scale.clamp_min(1e-12)).max().item()
        # the output's bfloat16 rounding (2^-9 of it) bounds the panels (measured up to 1.3e-3); the
        # int8 activations add more (measured 2.4e-3 to 3.2e-3), which this bound would refuse
        gemm = rows >= gemm_from_rows(kernels, part) and gemm_takes(kernels, part)
        assert bool(taken) == gemm, rows
        panels = rows >= PANEL_FROM_ROWS and not gemm and not kernels.dots_over_panels(int(qtype))
        assert worst < (2 ** -9 if panels else 2 ** -5), (rows, worst)
        if gemm:
            dots, same_dtype = torch.empty(rows, n_out), torch.empty(rows, n_out, dtype=torch.bfloat16)
            kernels.matmul(part.data, int(qtype), k, kernels.quantize(x), dots)
            kernels.matmul(part.data, int(qtype), k, kernels.quantize(x), same_dtype)
            assert torch.equal(got, same_dtype.double()) or not alike
            assert ((got - dots.double()).abs() <= 2 ** -8 * dots.double().abs() + 1e-5 * scale).all()
    assert weight.alike_rows(torch.bfloat16) == (None if alike else PANEL_FROM_ROWS - 1)
