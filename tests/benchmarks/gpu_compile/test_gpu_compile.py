"""The compile check of the GPU path (python -m kvserve.benchmarks.gpu_compile): its quick table
compiled for sm_80, sm_89 and sm_90 without a GPU, spill-free and within shared memory; the
configurations it compiles are the launchers' own; its verdicts and occupancy arithmetic."""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (the dev and gpu extras bring it)")

from kvserve.benchmarks.gpu_compile.compile import Result, signature  # noqa: E402
from kvserve.benchmarks.gpu_compile.shapes import full_table, quick_table  # noqa: E402
from kvserve.benchmarks.gpu_compile.targets import TARGETS, roofline_us  # noqa: E402
from kvserve.kernels.triton.launch import decode_launch, prefill_launch  # noqa: E402


def _nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_quick_table_compiles_for_every_target_without_spills(tmp_path):
    """Runs in a fresh process: the interpreter (TRITON_INTERPRET=1, set for the other kernel
    tests) patches triton.language and compiles nothing. An empty Triton cache: every cubin is
    compiled here, none read back from an earlier run."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "kvserve.benchmarks.gpu_compile", "--table", "quick", "--jobs", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| _")]
    assert len(rows) == 3 * len(quick_table())
    assert {r[3] for r in rows} == set(TARGETS)
    kernels = {r[0].strip("| ") for r in rows}
    assert kernels == {"_paged_decode_kernel", "_reduce_splits_kernel", "_paged_prefill_kernel",
                       "_store_kv_kernel", "_grouped_gemm_kernel"}  # fmt: skip
    head_dim_128 = [r for r in rows if r[1].startswith("d128 g4") and "_paged_" in r[0]]
    # decode, split decode, prefill and their sliding-window variants (decode, prefill), 3 targets each
    assert len(head_dim_128) == 15 and all(r[7] == "0" and r[-1].startswith("ok") for r in head_dim_128)
    assert sum(r[1].endswith("window") for r in head_dim_128) == 6


def test_the_tables_compile_the_launchers_configurations():
    full = {(c.kernel, c.shape, c.dtype): c.launch for c in full_table()}
    assert full[("_paged_decode_kernel", "d128 g8 kv8 blk16 split", "bf16")] == decode_launch(
        128, 8, 16, True, True
    )
    assert full[("_paged_prefill_kernel", "d64 g3 kv8 blk32", "fp16")] == prefill_launch(64, 3, 32, True)
    assert full[("_paged_prefill_kernel", "d256 g4 kv8 blk16 window", "bf16")] == prefill_launch(
        256, 4, 16, True, windowed=True
    )
    assert {c.kernel for c in quick_table()} == {c.kernel for c in full_table()}
    assert {d for (_, _, d) in full} == {"bf16", "fp16", "fp32"}


def test_the_signature_marks_constexprs_pointers_and_unspecialized_integers():
    from kvserve.kernels.triton.paged_attention import _paged_decode_kernel

    case = next(c for c in quick_table() if c.kernel == "_paged_decode_kernel")
    sig, consts, attrs = signature(_paged_decode_kernel, case)
    names = _paged_decode_kernel.arg_names
    assert sig["q_ptr"] == "*bf16" and sig["part_out_ptr"] == "*fp32" and sig["scale"] == "fp32"
    assert consts[(names.index("HEAD_DIM"),)] == 128 and sig["HEAD_DIM"] == "constexpr"
    assert (names.index("q_stride_t"),) in attrs and (
        names.index("bt_stride"),
    ) not in attrs  # do_not_specialize
    bad = type(case)(case.kernel, case.shape, case.dtype, type(case.launch)({"NOT_A_PARAM": 1}), 0, 0)
    with pytest.raises(ValueError, match="NOT_A_PARAM"):
        signature(_paged_decode_kernel, bad)


def test_spills_shared_memory_and_compile_errors_fail_and_occupancy_counts_the_tightest_limit():
    case = quick_table()[0]  # eight warps
    sm90, sm89 = TARGETS["sm_90"], TARGETS["sm_89"]
    assert Result(case, sm90, regs=64, smem=40 << 10).problems() == []
    assert Result(case, sm90, regs=255, stack=72).problems() == ["spills (72 B stack, 0 B local)"]
    assert "shared memory" in Result(case, sm89, regs=64, smem=100 << 10).problems()[0]
    assert Result(case, sm90, error="CompilationError: x").problems() == [
        "compile error: CompilationError: x"
    ]
    assert sm90.ctas_per_sm(regs=64, smem=0, num_warps=8) == 4  # 64 x 256 threads = 16K registers
    assert sm90.ctas_per_sm(regs=255, smem=0, num_warps=8) == 1  # registers bind
    assert sm90.ctas_per_sm(regs=32, smem=100 << 10, num_warps=4) == 2  # shared memory binds
    assert sm89.ctas_per_sm(regs=32, smem=0, num_warps=8) == 6  # 48 warps per SM on sm_89
    assert roofline_us(4.8e6, 0) == pytest.approx(1.0) and roofline_us(0, 989e6) == pytest.approx(1.0)


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_fla_cores_launches_are_recorded_from_its_host_code_and_compile(tmp_path):
    """The full table's fla-core rows: its host code's launches for the layer's two calls (every
    chunked-form kernel, the fused recurrent one), recorded without compiling or launching, and one
    compiled for sm_80 without spills. In a fresh process: the interpreter compiles nothing."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="needs fla-core: pip install .[gpu]")
    script = (
        "import json\n"
        "from kvserve.benchmarks.gpu_compile.compile import compile_case\n"
        "from kvserve.benchmarks.gpu_compile.fla_kernels import fla_cases\n"
        "from kvserve.benchmarks.gpu_compile.targets import TARGETS\n"
        "cases = fla_cases()\n"
        "print('kernels', json.dumps(sorted({c.kernel for c in cases})))\n"
        "print('shapes', json.dumps(sorted({c.shape for c in cases})))\n"
        "case = next(c for c in cases if c.kernel.startswith('fused_recurrent'))\n"
        "r = compile_case(case, TARGETS['sm_80'])\n"
        "print('compiled', r.regs > 0, r.problems())\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert json.loads(lines["kernels"]) == [
        "chunk_fwd_kernel_o", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "chunk_gated_delta_rule_fwd_kkt_solve_kernel", "chunk_local_cumsum_scalar_kernel",
        "fused_recurrent_gated_delta_rule_fwd_kernel", "l2norm_fwd_kernel", "recompute_w_u_fwd_kernel",
    ]  # fmt: skip
    assert json.loads(lines["shapes"]) == ["Qwen3-Next-80B decode B64", "Qwen3-Next-80B prefill T2048",
                                     "Qwen3.5-2B decode B64", "Qwen3.5-2B prefill T2048"]
    assert lines["compiled"] == "True []"


def test_an_autotuned_fla_kernel_fails_the_table_only_without_a_clean_configuration():
    """The engine's own kernels fail the table on any problem; fla-core's autotuned ones (recorded
    launches) only where no configuration of the kernel at that shape and target is clean."""
    from kvserve.benchmarks.gpu_compile.__main__ import failures
    from kvserve.benchmarks.gpu_compile.fla_kernels import RecordedLaunch
    from kvserve.benchmarks.gpu_compile.shapes import Case

    def fla(kernel, warps, index):
        return Case(kernel, "Qwen3.5-2B prefill T2048", "fp32", RecordedLaunch((), warps, 2), 0.0, 0.0,
                    recorded=index)

    sm80, sm89 = TARGETS["sm_80"], TARGETS["sm_89"]
    own = quick_table()[0]
    spill_1w, clean_4w, lone = fla("kkt_solve", 1, 0), fla("kkt_solve", 4, 1), fla("kernel_h", 2, 2)
    results = [
        Result(own, sm80, regs=255, stack=8),  # the engine's own kernel spills: fails
        Result(spill_1w, sm80, regs=255, stack=744),  # beside a clean configuration: passes
        Result(clean_4w, sm80, regs=128),
        Result(spill_1w, sm89, regs=255, stack=744),  # on sm_89 its sibling does not fit: both fail
        Result(clean_4w, sm89, regs=128, smem=sm89.max_smem_per_block + 1),
        Result(lone, sm80, regs=255, local=16),  # the only configuration of its kernel: fails
    ]
    assert failures(results) == [results[0], results[3], results[4], results[5]]
    assert failures([results[1], results[2]]) == []
