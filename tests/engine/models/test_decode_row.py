"""The fused decode step (engine/models/decode_row.py, kernels/cpu/csrc/decode_row.c) against the
per-op path it replaces: the same kernels in the same order, so the same tokens and the same
log-probabilities, in float32 and bfloat16, with int8 weights, an int8 KV cache and Qwen2's
biases, one sequence at a time and several (up to MAX_FUSED_ROWS) side by side; in bfloat16 with
csrc/gemm.c's packed weights, batches of more rows too."""

from __future__ import annotations

import pytest
import torch

from kvserve.benchmarks.attention_cpu import step_input
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.decode_row import DecodeRow, projections
from kvserve.kernels.cpu import bindings as cpu_kernels
from kvserve.kernels.cpu.abi import MAX_FUSED_ROWS, PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


def _needs_row_kernel(quantization: str | None) -> None:
    """Skips where the fused step's row kernel does not take these weights unpacked: any on AVX-512
    (int4 with AVX512-VNNI), int8 and int4 on AVX2 (csrc/linear_avx2.c)."""
    if _kernels is None or not _kernels.fused_rows:
        pytest.skip("the fused decode step is built for x86 CPUs")
    if quantization and _kernels.quantized_activation_block(576):
        return
    if quantization == "int4" or not _kernels.fused_row_kernel:
        pytest.skip("the row kernel takes these weights on AVX-512 CPUs only (int4: with AVX512-VNNI)")


def _fused_steps(monkeypatch) -> list[bool]:
    """Records whether each fused call ran (False: not built for AVX-512 here)."""
    calls: list[bool] = []
    real = cpu_kernels.CpuKernels.decode_row

    def counted(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(cpu_kernels.CpuKernels, "decode_row", counted)
    return calls


def _generate(llm: LLM, fused: bool, prompts=PROMPTS, together: bool = False
              ) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probabilities, one prompt at a time (every decode step one
    token) or all together (decode steps of several rows; the different output lengths make
    the batch shrink as they finish)."""
    model = llm.engine.executor.model.model
    model._decode_row = DecodeRow(model) if fused else None
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    if together:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params, strict=True)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


_kernels = load_kernels()
needs_kernels = pytest.mark.skipif(_kernels is None or not _kernels.fused_row_kernel,
                                   reason="the fused step takes float weights unpacked on AVX-512 CPUs only")
# built on x86 without AVX-512 too, taking steps whose projections all go through csrc/gemm.c
needs_fused = pytest.mark.skipif(_kernels is None or not _kernels.fused_rows,
                                 reason="the fused decode step is built for x86 CPUs")


@pytest.mark.parametrize(("dtype", "quantization", "kv_cache_dtype"), [
    ("float32", None, "auto"), ("bfloat16", None, "auto"), ("bfloat16", "int8", "auto"),
    ("bfloat16", "int4", "auto"),  # (int4 weights: AVX512-VNNI or AVX2 CPUs; elsewhere neither path's kernel)
    ("float32", None, "int8"),  # the int8 KV cache: stored and read by the same kernels on both paths
])
def test_fused_step_gives_the_per_op_paths_tokens_and_logprobs(dtype, quantization, kv_cache_dtype,
                                                                monkeypatch):
    """One sequence at a time, the fused step and the per-op path run the same kernels: the same
    tokens and log-probabilities. Together (decode steps of 4, 3, 2, 1 rows) the per-op path of
    a float model multiplies in oneDNN's GEMMs, whose sums run in another order: in float32 the
    same tokens and log-probabilities within 1e-4 (in bfloat16 a near tie may flip a token; the
    next test pins the rows there)."""
    _needs_row_kernel(quantization)
    options = {"quantization": quantization} if quantization else {}
    llm = LLM("default", dtype=dtype, max_num_seqs=len(PROMPTS), num_kv_blocks=64,
              kv_cache_dtype=kv_cache_dtype, **options)
    assert DecodeRow.fits(llm.engine.executor.model.model)
    calls = _fused_steps(monkeypatch)
    alone = _generate(llm, True)
    assert len(calls) == 5 + 7 + 9 + 11 and all(calls)  # every decode step of every prompt
    calls.clear()
    together = _generate(llm, True, together=True)
    assert len(calls) == 11 and all(calls)  # 4 rows, then 3, 2, 1 as the outputs end
    calls.clear()
    pairs = [(alone, _generate(llm, False), 1e-5)]
    # (an int8 cache rounds K/V to steps of max/127, so the GEMMs' other summation order moves some
    # values by a step; tests/engine/layers/attention/test_kv_int8.py bounds what that does to batched tokens)
    if dtype == "float32" and kv_cache_dtype == "auto":
        pairs.append((together, _generate(llm, False, together=True), 1e-4))
    for fused, per_op, tol in pairs:
        assert [t for t, _ in fused] == [t for t, _ in per_op]
        for (_, a), (_, b) in zip(fused, per_op, strict=True):
            assert a == pytest.approx(b, abs=tol)
    assert not calls
    llm.shutdown()


@pytest.mark.parametrize(("dtype", "quantization"),
                         [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, quantization, monkeypatch):
    """Eight decode rows over different contexts (a cache of random K/V) through the fused step
    at once, five of them, and each alone: bit for bit the same hidden states, so a sequence's
    tokens do not depend on what else is decoding beside it (up to MAX_FUSED_ROWS rows; the row
    kernel takes 1, 2 or 4 weight rows at a time by the number of rows)."""
    _needs_row_kernel(quantization)
    options = {"quantization": quantization} if quantization else {}
    llm = LLM("default", dtype=dtype, max_num_seqs=8, num_kv_blocks=64, **options)
    runner = llm.engine.executor
    model = runner.model.model
    gen = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=gen) * 0.5).to(runner.kv_cache.dtype))
    block = runner.block_size
    seqs = [([3, 9], 20, 1), ([1], 4, 1), ([12, 4, 7, 30], 50, 1), ([2, 5], 16, 1), ([40, 41, 42], 33, 1),
            ([6], 9, 1), ([13, 14], 27, 1), ([8, 0, 21], 40, 1)]
    ids = torch.tensor([11, 222, 3333, 444, 55, 6666, 77, 888])
    calls = _fused_steps(monkeypatch)

    def forward(rows):
        inp = step_input(block, [seqs[i] for i in rows])
        meta = runner.backend.build_metadata(inp, torch.device("cpu"))
        with torch.inference_mode():
            return model(ids[rows], torch.tensor(inp.positions), meta)

    together, five = forward(list(range(8))), forward([0, 1, 2, 3, 4])
    for i in range(8):
        alone = forward([i])
        assert torch.equal(together[i : i + 1], alone) and (i >= 5 or torch.equal(five[i : i + 1], alone))
    assert len(calls) == 10 and all(calls)
    llm.shutdown()


@needs_kernels
def test_fused_step_with_qkv_biases(tiny_qwen2_dir, monkeypatch):
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", max_num_seqs=1, num_kv_blocks=64)
    model = llm.engine.executor.model.model
    assert DecodeRow.fits(model) and model.layers[0].self_attn.qkv_proj.bias is not None
    _assert_fused_matches_per_op(llm, monkeypatch, stride=7)
    llm.shutdown()


def _assert_fused_matches_per_op(llm: LLM, monkeypatch, stride: int) -> None:
    """Three token-id prompts, one at a time: the fused step runs and gives the per-op path's
    tokens and (float32) log-probabilities."""
    calls = _fused_steps(monkeypatch)
    prompts = [[(stride * i + j) % llm.engine.vocab_size for j in range(4 + i)] for i in range(3)]
    fused = _generate(llm, True, prompts)
    assert calls and all(calls)
    per_op = _generate(llm, False, prompts)
    assert [t for t, _ in fused] == [t for t, _ in per_op]
    for (_, a), (_, b) in zip(fused, per_op, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_layers_it_does_not_compute_are_left_to_the_per_op_path(tmp_path):
    """Qwen3's per-head q/k norms are not in the fused layer: such a model keeps the per-op path."""
    from kvserve.testing.random_model import main as write_random_model
    write_random_model(["qwen3-tiny", str(tmp_path)])
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=1, num_kv_blocks=16)
    model = llm.engine.executor.model.model
    assert not DecodeRow.fits(model) and model.decode_row() is None
    llm.shutdown()


@needs_kernels
def test_fused_step_with_output_and_down_projection_biases(tmp_path, monkeypatch):
    """A Llama with attention_bias and mlp_bias (biases on q/k/v, o, gate/up and down): the fused
    step adds every one of them as the per-op path does."""
    from kvserve.testing.random_model import make_config, write_model_dir

    path = write_model_dir(make_config("llama-tiny", attention_bias=True, mlp_bias=True), tmp_path,
                           dtype=torch.float32)
    llm = LLM(str(path), dtype="float32", max_num_seqs=1, num_kv_blocks=64)
    model = llm.engine.executor.model.model
    layer = model.layers[0]
    assert DecodeRow.fits(model)
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    _assert_fused_matches_per_op(llm, monkeypatch, stride=11)
    llm.shutdown()


@needs_kernels
def test_rows_without_a_cache_slot_and_batches_above_the_limit_take_the_per_op_path(monkeypatch):
    """A row whose slot is -1 (nothing to store: a padding row) makes the C call refuse the step,
    and the per-op path computes it, with the per-op path's result; in float32 (no gemm.c copies) a
    decode step of more rows than MAX_FUSED_ROWS is refused before the kernel call."""
    llm = LLM("default", dtype="float32", max_num_seqs=MAX_FUSED_ROWS + 1, num_kv_blocks=64)
    runner = llm.engine.executor
    model = runner.model.model
    gen = torch.Generator().manual_seed(1)
    runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=gen) * 0.5).to(runner.kv_cache.dtype))
    seqs = [([3, 9], 20, 1), ([1], 4, 1)]
    ids = torch.tensor([11, 222])
    calls = _fused_steps(monkeypatch)

    def forward(fused: bool):
        model._decode_row = DecodeRow(model) if fused else None
        inp = step_input(runner.block_size, seqs)
        inp.slot_mapping[1] = -1
        meta = runner.backend.build_metadata(inp, torch.device("cpu"))
        with torch.inference_mode():
            return model(ids, torch.tensor(inp.positions), meta)

    assert torch.equal(forward(True), forward(False))
    assert calls == [False]  # asked once, refused: the per-op path ran

    rows = []
    real_call = DecodeRow.__call__
    monkeypatch.setattr(DecodeRow, "__call__", lambda self, hidden, *a: rows.append(hidden.shape[0])
                        or real_call(self, hidden, *a))
    calls.clear()
    n = MAX_FUSED_ROWS + 1
    prompts = [[(5 * i + j) % llm.engine.vocab_size for j in range(3 + i)] for i in range(n)]
    # request i makes 4 + 2i tokens: the first decode steps have n rows, then the batch shrinks
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(n)]
    model._decode_row = DecodeRow(model)
    llm.generate(prompts, params, use_tqdm=False)
    # (the first step prefills every prompt, 63 tokens in one step: asked too, and refused at once)
    assert rows[0] == sum(map(len, prompts)) and rows[1] == MAX_FUSED_ROWS + 1 and all(calls)
    assert len(calls) == sum(r <= MAX_FUSED_ROWS for r in rows)  # the steps of n rows never reached C
    llm.shutdown()


@needs_fused
def test_batches_of_any_size_through_gemm_give_the_per_op_paths_results(monkeypatch):
    """bfloat16 with every projection packed for csrc/gemm.c: a decode step of any number of rows,
    above MAX_FUSED_ROWS too, runs fused, the projections in gemm.c's tiles as the per-op path
    multiplies them, with the same attention and elementwise kernels: bit for bit the per-op path's
    hidden states (1 to 20 rows over a cache of random K/V), each row's alone as in the batch, and
    the same tokens and log-probabilities (12 sequences decoding together to the end)."""
    # (no prefix caching: the second run would prefill the prompts' last tokens alone, another sum)
    # (no step time bound: it cuts prefill chunks by measured step times, and where the prefills go
    # to SDPA (AMX, no AVX-512) a prompt's logits depend on where its chunks end)
    llm = LLM("default", dtype="bfloat16", max_num_seqs=20, num_kv_blocks=128, enable_prefix_caching=False,
              max_step_time_ms=0)
    runner = llm.engine.executor
    model = runner.model.model
    if not all(isinstance(m.packed, PackedWeight) for m in projections(model)):
        llm.shutdown()
        pytest.skip("csrc/gemm.c packs the weights where it is built (AVX-512, AVX2), without AMX")
    calls = _fused_steps(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    runner.kv_cache.copy_((torch.randn(runner.kv_cache.shape, generator=gen) * 0.5).to(runner.kv_cache.dtype))

    def forward(n: int, fused: bool):
        model._decode_row = DecodeRow(model) if fused else None
        seqs = [([4 * i + j for j in range(4)], 7 + 5 * i % 50, 1) for i in range(n)]  # 7..52 cached
        inp = step_input(runner.block_size, seqs)
        meta = runner.backend.build_metadata(inp, torch.device("cpu"))
        with torch.inference_mode():
            return model(torch.arange(n) * 37 + 5, torch.tensor(inp.positions), meta)

    sizes = (1, 3, MAX_FUSED_ROWS, MAX_FUSED_ROWS + 1, 12, 20)
    batches = {n: forward(n, True) for n in sizes}
    for n in sizes:
        assert torch.equal(batches[n], forward(n, False))
        assert torch.equal(batches[n], batches[20][:n])  # row i sees the same context in every batch
    assert calls == [True] * len(sizes)
    prompts = [[(13 * i + j) % llm.engine.vocab_size for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)

    def tokens(fused: bool):
        model._decode_row = DecodeRow(model) if fused else None
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    calls.clear()
    fused = tokens(True)
    assert calls == [True] * 7  # every decode step, 12 rows each
    assert tokens(False) == fused and len(calls) == 7
    llm.shutdown()
