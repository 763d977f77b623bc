"""The fused one-token step (engine/models/decode_row.py, kernels/csrc/decode_row.c) against the
per-op path it replaces: the same kernels in the same order, so the same tokens and the same
log-probabilities, in float32 and bfloat16, with int8 weights and with Qwen2's biases."""

from __future__ import annotations

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.decode_row import DecodeRow
from kvserve.kernels import cpu_kernels
from kvserve.kernels.cpu_kernels import load_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time"]


def _fused_steps(monkeypatch) -> list[bool]:
    """Records whether each fused call ran (False: not built for AVX-512 here)."""
    calls: list[bool] = []
    real = cpu_kernels.CpuKernels.decode_row

    def counted(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(cpu_kernels.CpuKernels, "decode_row", counted)
    return calls


def _generate(llm: LLM, fused: bool, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    model = llm.engine.executor.model.model
    model._decode_row = DecodeRow(model) if fused else None
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    out = []
    for prompt in prompts:  # one at a time: every decode step is one token
        o = llm.generate(prompt, params, use_tqdm=False)[0]
        out.append((o.token_ids, [lp.logprob for lp in o.logprobs]))
    return out


needs_kernels = pytest.mark.skipif(load_kernels() is None, reason="no CPU kernels here")


@needs_kernels
@pytest.mark.parametrize(("dtype", "quantization"),
                         [("float32", None), ("bfloat16", None), ("bfloat16", "int8")])
def test_fused_step_gives_the_per_op_paths_tokens_and_logprobs(dtype, quantization, monkeypatch):
    options = {"quantization": quantization} if quantization else {}
    llm = LLM("default", dtype=dtype, max_num_seqs=1, num_kv_blocks=64, **options)
    assert DecodeRow.fits(llm.engine.executor.model.model)
    calls = _fused_steps(monkeypatch)
    fused = _generate(llm, fused=True)
    if not any(calls):
        pytest.skip("the kernels were not built for AVX-512 here: the fused step does not run")
    assert len(calls) >= len(PROMPTS) * 9  # every decode step of every prompt
    calls.clear()
    per_op = _generate(llm, fused=False)
    assert not calls
    assert [t for t, _ in fused] == [t for t, _ in per_op]
    for (_, a), (_, b) in zip(fused, per_op, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    llm.shutdown()


@needs_kernels
def test_fused_step_with_qkv_biases(tiny_qwen2_dir, monkeypatch):
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", max_num_seqs=1, num_kv_blocks=64)
    model = llm.engine.executor.model.model
    assert DecodeRow.fits(model) and model.layers[0].self_attn.qkv_proj.bias is not None
    calls = _fused_steps(monkeypatch)
    prompts = [[(7 * i + j) % llm.engine.vocab_size for j in range(5 + i)] for i in range(3)]
    fused = _generate(llm, True, prompts)
    if not any(calls):
        pytest.skip("the kernels were not built for AVX-512 here")
    per_op = _generate(llm, False, prompts)
    assert [t for t, _ in fused] == [t for t, _ in per_op]
    for (_, a), (_, b) in zip(fused, per_op, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    llm.shutdown()


def test_layers_it_does_not_compute_are_left_to_the_per_op_path(tmp_path):
    """Qwen3's per-head q/k norms are not in the fused layer: such a model keeps the per-op path."""
    from kvserve.benchmarks.random_model import main as write_random_model
    write_random_model(["qwen3-tiny", str(tmp_path)])
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=1, num_kv_blocks=16)
    model = llm.engine.executor.model.model
    assert not DecodeRow.fits(model) and model.decode_row() is None
    llm.shutdown()
