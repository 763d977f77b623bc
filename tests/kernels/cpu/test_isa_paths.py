"""The exactness promises on every x86 CPU class kvserve builds a path for, run on the machine at
hand (``kvserve.testing.process``): speculation on and off, packed and plain weights, the fused
decode step and the per-op path, gemm.c's rows alike, GGUF block formats (csrc/kquant*.c's dots,
a K-quant model's greedy tokens, its memory and its fused decode step), the gated delta rule (csrc/
gated_delta.c), each under a build for the class (skipped where this CPU cannot run it). Slow (a
few minutes a class, each its own build): ``make test-isa``. Also: gemm.c's 512-bit tiles without
BF16 give the AVX2 tiles' bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvserve.testing.process import CLASSES, class_env, run_pytest, runs_here

EXACTNESS_TESTS = ["tests/engine/core/test_speculation.py", "tests/engine/layers/test_packed_weights.py",
                   "tests/engine/models/test_decode_row.py", "tests/engine/models/test_decode_row_groups.py",
                   "tests/kernels/cpu/test_decode_row_hybrid.py",
                   "tests/kernels/cpu/test_gemm.py", "tests/kernels/cpu/kquant/test_kquant.py",
                   "tests/kernels/cpu/kquant/test_kquant_gemm.py",
                   "tests/kernels/cpu/kquant/test_kquant_x16.py",
                   "tests/engine/layers/test_gguf_linear.py",
                   "tests/engine/layers/test_gguf_model.py",
                   "tests/engine/spec_decode/test_gguf_speculation.py",
                   "tests/engine/layers/attention/test_attention_variants.py",
                   "tests/kernels/cpu/test_attention_window_tiles.py",
                   "tests/kernels/cpu/test_gated_delta.py"]
CLASS = {c.name: c for c in CLASSES}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CLASS))
def test_exactness_tests_pass_on_each_cpu_class(name, tmp_path):
    cls = CLASS[name]
    if not runs_here(cls):
        pytest.skip(f"this CPU does not run code built for {name} ({cls.march})")
    done = run_pytest(EXACTNESS_TESTS, class_env(cls, tmp_path), 1800)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]


GEMM_PRODUCTS = """
import sys, torch
from kvserve.kernels.cpu.bindings import load_kernels
k = load_kernels()
g = torch.Generator().manual_seed(0)
out = {}
for n, kk in [(960, 576), (96, 130), (3072, 64)]:
    w = (torch.randn(n, kk, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    p = k.pack_gemm_weight(w)
    for rows in (1, 5, 8, 9, 47, 61, 600):
        x = torch.randn(rows, kk, generator=g).to(torch.bfloat16)
        out[f"{n}x{kk}@{rows}"] = k.gemm(x, p, b)
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
def test_gemm_tiles_without_bf16_give_the_avx2_tiles_bits(tmp_path):
    """AVX-512 F's tiles sum each output even then odd input over k as the AVX2 tiles do: the same
    bits at every row count, with a bias. (gate|up's silu is each build's own exp, whose vector forms
    round n differently: test_gemm checks it per build.)"""
    avx512, avx2 = CLASS["avx512"], CLASS["avx2"]
    if not runs_here(avx512):
        pytest.skip("this CPU does not run the AVX-512 build")
    script = tmp_path / "products.py"
    script.write_text(GEMM_PRODUCTS)
    results = []
    for cls in (avx512, avx2):
        out = tmp_path / f"{cls.name}.pt"
        env = {**os.environ, **class_env(cls, tmp_path)}
        subprocess.run([sys.executable, str(script), str(out)], env=env, check=True, timeout=900)
        results.append(torch.load(out))
    assert results[0].keys() == results[1].keys()
    assert [k for k in results[0] if not torch.equal(results[0][k], results[1][k])] == []
