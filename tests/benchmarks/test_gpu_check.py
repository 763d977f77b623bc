"""benchmarks/gpu_check.sh, smoke-run on the CPU (GPU_CHECK_ON_CPU=1): what a GPU run leaves in
its output folder (a summary and a few short logs, nothing large) and that its scratch (the random
model, the path shim, full logs) is gone afterwards. The throughput step alone runs in the normal
suite; every step in the slow one."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
MAX_FILES, MAX_BYTES = 8, 16 << 20  # what comes back from a GPU run


def run_check(tmp_path: Path, *steps: str, timeout: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "GPU_CHECK_ON_CPU": "1", "OUT": str(out), "TMPDIR": str(scratch)}
    done = subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    return done, out, scratch


def assert_small_output(out: Path, steps: list[str]) -> str:
    files = sorted(p for p in out.rglob("*") if p.is_file())
    assert [p.name for p in files] == sorted(["summary.md", *(f"{s}.log" for s in steps)])
    assert len(files) <= MAX_FILES and all(p.stat().st_size <= MAX_BYTES for p in files)
    return (out / "summary.md").read_text()


@pytest.mark.slow
def test_throughput_step_leaves_a_summary_and_one_short_log_and_no_scratch(tmp_path):
    done, out, scratch = run_check(tmp_path, "throughput", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = assert_small_output(out, ["throughput"])
    assert "CPU (smoke run)" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| throughput |"))
    assert "| pass |" in row and "output_tokens=" in row and "output tok/s" in row
    assert not list(scratch.glob("kvserve-gpu-scratch.*"))  # the random model and the full logs are removed


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    done, out, _ = run_check(tmp_path, "kernels", "speed", timeout=60)
    assert done.returncode == 2
    assert "unknown step 'speed'" in done.stderr
    assert "kernels parity moe graphs timing throughput" in done.stderr
    assert [p.name for p in out.iterdir()] == ["preflight.log"]


@pytest.mark.slow
def test_every_step_passes_on_the_cpu_within_the_budget(tmp_path):
    done, out, scratch = run_check(tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = assert_small_output(out, ["kernels", "parity", "moe", "graphs", "timing", "throughput"])
    assert summary.count("| pass |") == 6
    assert "| kernel (cpu) | measured us | expected us (H200 roofline) | measured / expected |" in summary
    assert not list(scratch.glob("kvserve-gpu-scratch.*"))
