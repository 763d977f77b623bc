"""The sampler's CPU kernels (kernels/cpu/csrc/sampling.c): the greedy argmax against torch's, in the
build the engine loads and in the portable build (no AVX-512), and the inverse-CDF draw against a
float64 cumulative softmax."""

import ctypes
import subprocess

import pytest
import torch

from kvserve.kernels.cpu import build as cpu_build
from kvserve.kernels.cpu.bindings import load_kernels

KERNEL = load_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the torch-ops path serves")


def _argmax_cases() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(300, 10_240, generator=gen)
    logits[1, [7, 9000]] = 50.0  # a tie: the first wins
    logits[2] = 0.0  # all equal: index 0
    logits[3, 4000] = float("nan")  # NaN wins, as in torch
    logits[4, 10_239] = float("inf")
    logits[5, :300] = float("-inf")
    logits[6, [123, 5000]] = torch.tensor([-float("nan"), float("nan")])  # x86 makes negative NaNs
    logits[7] = -float("inf")  # nothing but -inf: index 0
    logits[8] = -1.0
    logits[8, [300, 700]] = torch.tensor([-0.0, 0.0])  # -0 and +0 are equal: the first wins
    logits[9, 10_239] = 60.0  # the largest in the last (short) chunk's tail
    logits[10, ::2] = 5.0  # ties in every lane
    return logits


def _check_argmax(argmax) -> None:
    logits = _argmax_cases()
    assert torch.equal(argmax(logits), logits.argmax(-1))
    narrow = logits[:, :100]  # rows not contiguous with each other, width below one chunk
    assert torch.equal(argmax(narrow), narrow.argmax(-1))
    for width in (1, 15, 17, 33, 255, 257, 10_001):  # every tail of the vector steps and chunks
        part = logits[:, -width:]
        assert torch.equal(argmax(part), part.argmax(-1)), width


def test_argmax_is_torchs_first_maximum_with_ties_and_nan():
    _check_argmax(KERNEL.argmax)


def test_argmax_without_avx512_is_torchs_too(tmp_path):
    """The portable argmax (CPUs without AVX-512) against torch: sampling.c built on its own
    with AVX-512 switched off."""
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lib = tmp_path / "sampling_portable.so"
    source = cpu_build.SOURCE_DIR / "sampling.c"
    subprocess.run([cc, *cpu_build.FLAGS, "-mno-avx512f", "-o", str(lib), str(source)], check=True,
                   capture_output=True)
    argmax_rows = ctypes.CDLL(str(lib)).argmax_rows
    argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                            ctypes.c_int]

    def argmax(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.int64)
        assert argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), 1) == 0
        return out

    _check_argmax(argmax)


def test_inverse_cdf_draw_picks_the_interval_that_holds_the_target():
    """Against a float64 cumulative softmax: the same token wherever the target is not within
    1e-5 of an interval's edge (the kernel's exp differs from torch's in the 7th digit); masked
    tokens never; u = 0 gives the first allowed token, u close to 1 the last."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 10_000, generator=gen) * 3
    logits[:, ::3] = float("-inf")  # masked (top-k/top-p/min-p leave -inf)
    logits[0, :] = float("-inf")
    logits[0, 7] = 1.0  # one allowed token
    uniforms = torch.rand(64, generator=gen)
    uniforms[1], uniforms[2] = 0.0, 1.0 - 2**-24
    got = KERNEL.inverse_cdf_draw(logits.clone(), uniforms)
    p = torch.softmax(logits.double(), dim=-1)
    cdf = p.cumsum(-1)
    target = uniforms.double().unsqueeze(1)
    want = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logits.shape[1] - 1)
    near_edge = ((cdf - target).abs() < 1e-5).any(-1)
    assert torch.equal(got[~near_edge], want[~near_edge])
    assert int((~near_edge).sum()) >= 40  # most rows are compared
    assert torch.isfinite(logits[torch.arange(64), got]).all()
    assert got[0] == 7
    allowed = torch.isfinite(logits[1]).nonzero().flatten()
    assert got[1] == allowed[0] and got[2] == torch.isfinite(logits[2]).nonzero().flatten()[-1]
