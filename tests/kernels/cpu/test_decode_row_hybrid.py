"""The hybrid's fused decode step (engine/models/decode_row_hybrid.py, csrc/decode_row.c
``decode_row_hybrid``) against the per-op path it replaces, on tiny random Qwen3.5 checkpoints whose
linear layers steer the tokens: the same kernels in the same order, so the same greedy tokens and
the same log-probabilities bit for bit, in float32 and bfloat16, with the projections in linear.c's
row kernel (unpacked weights: AVX-512 builds) and in csrc/gemm.c's packed copies (bfloat16 weights
whose every projection packs: AVX-512 and AVX2 builds), one sequence at a time and, packed,
several side by side. Qwen3-Next (its own mixer, mixtures of experts) is refused."""

from __future__ import annotations

import pytest

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.models.decode_row_hybrid import HybridDecodeRow, refusal
from kvserve.kernels.cpu import gated_delta as gdn_kernels
from kvserve.kernels.cpu.abi import PackedWeight
from kvserve.kernels.cpu.bindings import load_kernels
from kvserve.testing.engine import HYBRID_PROMPTS, scaled_hybrid_model

_kernels = load_kernels()
pytestmark = pytest.mark.skipif(_kernels is None or not _kernels.fused_rows,
                                reason="the fused decode step is built for x86 CPUs")
# the prompts' first 40 tokens (the fused step's work is the decode steps after them)
PROMPTS = [p[:40] for p in HYBRID_PROMPTS[:3]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """``tiny``: the hybrids' parity shape (an in-projection of 200 rows: not packed for gemm.c);
    ``packs``: 8 value heads, so that every projection is a multiple of 16 rows and packs."""
    return {"tiny": scaled_hybrid_model("qwen3.5-tiny", tmp_path_factory.mktemp("tiny")),
            "packs": scaled_hybrid_model("qwen3.5-tiny", tmp_path_factory.mktemp("packs"),
                                         linear_num_value_heads=8)}


def _fused_calls(monkeypatch) -> list[bool]:
    """Records whether each fused call ran."""
    calls: list[bool] = []
    real = gdn_kernels.GatedDeltaKernels.decode_row_hybrid

    def counted(self, *args):
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(gdn_kernels.GatedDeltaKernels, "decode_row_hybrid", counted)
    return calls


def _generate(llm: LLM, fused: bool, together: bool = False) -> list[tuple[list[int], list[float]]]:
    model = llm.engine.executor.model.model
    model._decode_row = HybridDecodeRow(model) if fused else None
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=1)
              for i in range(len(PROMPTS))]
    if together:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(PROMPTS, params, strict=True)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize(("model", "dtype", "quantization"),
                         [("tiny", "float32", None), ("tiny", "bfloat16", None), ("packs", "bfloat16", None),
                          ("packs", "bfloat16", "int8")])
def test_fused_hybrid_step_gives_the_per_op_paths_tokens_and_logprobs(model_dirs, model, dtype, quantization,
                                                                      monkeypatch):
    """(int8 weights: the row kernel's int8 path, AVX-512 builds; packed bfloat16: gemm.c's tiles.)"""
    options = {"quantization": quantization} if quantization else {}
    llm = LLM(model_dirs[model], dtype=dtype, max_num_seqs=len(PROMPTS), num_kv_blocks=64,
              enable_prefix_caching=False, **options)
    try:
        net = llm.engine.executor.model
        packed = all(isinstance(m.packed, PackedWeight)
                     for m in net.modules() if hasattr(m, "packed") and m is not net.lm_head)
        if not packed and not _kernels.fused_row_kernel:
            pytest.skip("unpacked projections go through the fused step's row kernel on AVX-512 builds only")
        assert refusal(net.model) is None
        calls = _fused_calls(monkeypatch)
        alone = _generate(llm, True)
        assert len(calls) == 5 + 7 + 9 and all(calls)  # every decode step of every prompt
        calls.clear()
        assert _generate(llm, False) == alone  # tokens and log-probabilities, bit for bit
        assert not calls
        if packed:  # gemm.c's tiles: a row's sums do not depend on the rows beside it
            together = _generate(llm, True, together=True)
            assert len(calls) == 9 and all(calls)  # 3 rows, then 2, then 1 as the outputs end
            assert together == alone == _generate(llm, False, together=True)
    finally:
        llm.shutdown()


def test_qwen3_next_is_refused_by_name(tmp_path):
    llm = LLM(scaled_hybrid_model("qwen3-next-tiny", tmp_path), dtype="float32", num_kv_blocks=32)
    try:
        why = refusal(llm.engine.executor.model.model)
        assert why is not None and "Qwen3Next" in why
        assert llm.engine.executor.model.model.decode_row() is None
    finally:
        llm.shutdown()
