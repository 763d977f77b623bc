"""The fused decode step (csrc/decode_row.c) over models of several KV cache groups and Gemma's
layers, against the layer-by-layer path it replaces, on tiny random checkpoints of transformers
5.24's own configs: windows of 8 tokens over blocks of 4, prompts several windows long, so that the
window groups' tables hold freed (NULL) columns and a layer that read another group's table would
read the wrong blocks. Mistral (one group, a window on every layer), Ministral (window and full
layers), Gemma 2 (alternating windows, attention logit soft cap, four norms a layer, GELU-tanh),
Gemma 3 (five window layers per full one, QK-norm, a rotary table per layer type); float32 and
bfloat16 (csrc/gemm.c's packed projections where the build has them). gpt-oss (sinks, a mixture
of experts) is refused by name and decodes layer by layer. Parity with transformers: the families'
tests (test_families.py, test_sliding_window_models.py) run with the fused step on."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.decode_row import DecodeRow, refusal
from kvserve.kernels.cpu import bindings as cpu_kernels
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.random_model import make_config, write_model_dir

BLOCK = 4
PROMPTS = [list(range(100, 131)), [7, 3, 9000, 12, 5], list(range(2000, 2050, 2)), [42] * 19]
FAMILIES = ["mistral-tiny", "ministral-tiny", "gemma2-tiny", "gemma3-tiny"]
_kernels = load_kernels()
needs_fused = pytest.mark.skipif(_kernels is None or not _kernels.fused_rows,
                                 reason="the fused decode step is built for x86 CPUs")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    names = [*FAMILIES, "gpt-oss-tiny"]
    return {name: str(write_model_dir(make_config(name), tmp_path_factory.mktemp(name), dtype=torch.float32))
            for name in names}


def _fused_calls(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    real = cpu_kernels.CpuKernels.decode_row

    def counted(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(cpu_kernels.CpuKernels, "decode_row", counted)
    return calls


def _generate(llm: LLM, fused: bool, together: bool) -> list[tuple[list[int], list[float]]]:
    model = llm.engine.executor.model.model
    model._decode_row = DecodeRow(model) if fused else None
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=1)
              for i in range(len(PROMPTS))]
    if together:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(PROMPTS, params, strict=True)]
    return [(list(o.token_ids), [lp.logprob for lp in o.logprobs]) for o in outs]


@needs_fused
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_fused_step_gives_the_layer_by_layer_tokens_and_logprobs(model_dirs, name, dtype, monkeypatch):
    """One prompt at a time, both paths run the same kernels in the same order (each layer on its
    own group's tables): the same tokens, log-probabilities within float32's last digits. All four
    prompts together (decode steps of 4, 3, 2, 1 rows): in float32 the same tokens and
    log-probabilities within 1e-4 (the per-op path's GEMMs sum in another order); in bfloat16 the
    rows go through gemm.c's packed tiles on both paths where the build has them."""
    if dtype == "float32" and not _kernels.fused_row_kernel:
        pytest.skip("float32 projections unpacked: the fused step's row kernel is built for AVX-512 only")
    llm = LLM(model_dirs[name], dtype=dtype, device="cpu", block_size=BLOCK, max_num_seqs=len(PROMPTS))
    try:
        model = llm.engine.executor.model.model
        assert refusal(model) is None
        groups = {layer.self_attn.attn.kv_group for layer in model.layers}
        assert (len(groups) == 1) == (name == "mistral-tiny"), groups
        calls = _fused_calls(monkeypatch)
        alone = _generate(llm, True, together=False)
        assert len(calls) == 5 + 7 + 9 + 11 and all(calls)  # every decode step of every prompt
        calls.clear()
        together = _generate(llm, True, together=True)
        assert len(calls) == 11 and all(calls)
        calls.clear()
        pairs = [(alone, _generate(llm, False, together=False), 1e-5)]
        if dtype == "float32":
            pairs.append((together, _generate(llm, False, together=True), 1e-4))
        assert not calls
    finally:
        llm.shutdown()
    for fused, per_op, tol in pairs:
        assert [t for t, _ in fused] == [t for t, _ in per_op]
        for (_, a), (_, b) in zip(fused, per_op, strict=True):
            assert a == pytest.approx(b, abs=tol)


@needs_fused
def test_a_gemma3_rows_result_does_not_depend_on_the_rows_beside_it(model_dirs, monkeypatch):
    """bfloat16 with gemm.c's packed projections (a row's sums do not depend on the row count
    there): each prompt's greedy tokens and log-probabilities are the same decoded alone (one-row
    steps) and beside the others (steps of up to four rows) through the fused step."""
    llm = LLM(model_dirs["gemma3-tiny"], dtype="bfloat16", device="cpu", block_size=BLOCK,
              max_num_seqs=len(PROMPTS))
    try:
        calls = _fused_calls(monkeypatch)
        alone, together = _generate(llm, True, together=False), _generate(llm, True, together=True)
        assert len(calls) == 32 + 11 and all(calls)
        packed = llm.engine.executor.model.model.decode_row()._any_rows
    finally:
        llm.shutdown()
    if not packed:
        pytest.skip("no packed bfloat16 weights in this build: the row kernel's sums follow the row count")
    assert alone == together


def test_gpt_oss_is_refused_by_name_and_decodes_layer_by_layer(model_dirs):
    """A mixture of experts (and sinks) the fused step does not compute: refused, naming the
    modules, and the model decodes through its layers."""
    llm = LLM(model_dirs["gpt-oss-tiny"], dtype="float32", device="cpu", block_size=BLOCK)
    try:
        model = llm.engine.executor.model.model
        why = refusal(model)
        assert model.decode_row() is None
        assert why is not None and "GptOssDecoderLayer" in why and "GptOssMoe" in why, why
        outs = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)
        assert len(outs[0].token_ids) == 4
    finally:
        llm.shutdown()
