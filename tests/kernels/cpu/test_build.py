"""The CPU kernels beyond this CPU (kernels/cpu/build.py): the whole library built for x86-64-v3
(AVX2, no AVX-512: the portable paths) passes every CPU-kernel test; it cross-compiles for aarch64,
so no x86-only code hides outside the guarded paths; with no C compiler, or one without OpenMP,
the engine runs torch ops after one clear warning and still matches transformers."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.kernels.cpu import build as cpu_build
from kvserve.testing.process import run_pytest

ROOT = Path(__file__).resolve().parents[3]
CPU_KERNEL_TESTS = ["tests/kernels/cpu/test_cpu_kernels.py", "tests/kernels/cpu/test_sampling_kernels.py"]
PARITY_TEST = ("tests/engine/runner/test_model_runner.py::"
               "test_random_qwen3_matches_transformers_qwen3_with_the_same_weights")  # fmt: skip
CROSS_CC = "aarch64-linux-gnu-gcc"


def test_march_override_names_the_target_and_refuses_a_flag_in_disguise(monkeypatch):
    monkeypatch.setenv(cpu_build.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in cpu_build.flags() and "-march=native" not in cpu_build.flags()
    monkeypatch.setenv(cpu_build.MARCH_ENV, "native -fplugin=x.so")
    with pytest.raises(RuntimeError, match="not a -march value"):
        cpu_build.flags()
    monkeypatch.delenv(cpu_build.MARCH_ENV)
    assert cpu_build.flags() == cpu_build.FLAGS


def test_no_compiler_means_torch_ops_one_warning_and_the_same_logits(tmp_path):
    done = run_pytest(
        [PARITY_TEST], {"CC": str(tmp_path / "missing-cc"), "KVSERVE_CACHE_DIR": str(tmp_path)}, 300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.count("no C compiler (cc, or $CC) found: the CPU path runs torch ops only") == 1
    assert not (tmp_path / "kernels").exists()


def test_a_compiler_without_openmp_means_torch_ops_one_warning_and_the_same_logits(tmp_path):
    """A compiler that refuses -fopenmp the way clang without libomp does."""
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler here at all (the no-compiler test covers this machine)")
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && '
                       f'{{ echo "clang: error: unsupported option \'-fopenmp\'" >&2; exit 1; }}; done\n'
                       f'exec {cc} "$@"\n')  # fmt: skip
    wrapper.chmod(0o755)
    done = run_pytest([PARITY_TEST], {"CC": str(wrapper), "KVSERVE_CACHE_DIR": str(tmp_path)}, 300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.stdout.count("building the CPU kernels failed, the CPU path runs torch ops only") == 1
    assert "has no OpenMP" in done.stdout


@pytest.mark.slow
def test_every_cpu_kernel_test_passes_on_the_x86_64_v3_build(tmp_path):
    """The library built for AVX2 without AVX-512 (KVSERVE_CPU_MARCH=x86-64-v3): every source
    takes its portable path; the CPU-kernel tests run against that build."""
    if os.uname().machine != "x86_64" or cpu_build.compiler() is None:
        pytest.skip("needs an x86-64 machine with a C compiler")
    env = {cpu_build.MARCH_ENV: "x86-64-v3", "KVSERVE_CACHE_DIR": str(tmp_path)}
    done = run_pytest(CPU_KERNEL_TESTS, env, 1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1]
    built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1
    symbols = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built[0])], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert "zmm" not in symbols  # no AVX-512 register anywhere: the portable paths only


@pytest.mark.slow
def test_the_library_cross_compiles_for_aarch64(tmp_path):
    """Every source compiled and linked by gcc-aarch64-linux-gnu (a Debian package) with the
    build's own flags for a generic ARMv8-A: an AArch64 shared object."""
    cross = shutil.which(CROSS_CC)
    if cross is None:
        pytest.skip(f"{CROSS_CC} is not installed (Debian: apt-get install gcc-aarch64-linux-gnu)")
    flags = [f if f != "-march=native" else "-march=armv8-a" for f in cpu_build.FLAGS if f != "-shared"]
    objects = []
    for src in cpu_build.sources():
        if src.suffix == ".c":
            obj = tmp_path / f"{src.stem}.o"
            cmd = [cross, *flags, "-Werror=implicit-function-declaration", "-c", "-o", str(obj), str(src)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
            objects.append(str(obj))
    lib = tmp_path / "cpu_kernels-aarch64.so"
    done = subprocess.run(
        [cross, *cpu_build.LINK_FLAGS, "-o", str(lib), *objects], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
