"""CPU threads: counted from the CPUs the process may use, overridable, and waiting passively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.process import threads
from kvserve.engine.runner.model_runner import ModelRunner


@pytest.fixture
def cgroup_files(tmp_path, monkeypatch):
    """Points the cgroup readers at files of the test's making (absent until written)."""
    paths = {name: tmp_path / name for name in ("cpu.max", "quota", "period")}
    monkeypatch.setattr(threads, "CGROUP_V2_CPU_MAX", str(paths["cpu.max"]))
    monkeypatch.setattr(threads, "CGROUP_V1_QUOTA", str(paths["quota"]))
    monkeypatch.setattr(threads, "CGROUP_V1_PERIOD", str(paths["period"]))
    return paths


def test_cgroup_v2_quota_caps_the_affinity_count(cgroup_files, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 64)
    cgroup_files["cpu.max"].write_text("150000 100000\n")
    assert threads.cgroup_cpu_quota() == 1.5
    assert threads.available_cpus() == 2  # 1.5 CPUs of time still run two threads
    cgroup_files["cpu.max"].write_text("max 100000\n")
    assert threads.available_cpus() == 64


def test_cgroup_v1_quota_and_no_cgroup_at_all(cgroup_files, monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: 8)
    assert threads.cgroup_cpu_quota() is None and threads.available_cpus() == 8
    cgroup_files["quota"].write_text("300000\n")
    cgroup_files["period"].write_text("100000\n")
    assert threads.available_cpus() == 3
    cgroup_files["quota"].write_text("-1\n")  # v1's "unlimited"
    assert threads.available_cpus() == 8


def test_affinity_mask_is_what_counts():
    assert threads.affinity_cpus() == len(os.sched_getaffinity(0))


def test_ranks_share_the_cpus_and_threads_overrides(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    assert threads.intra_op_threads(None) == 8
    assert threads.intra_op_threads(None, local_ranks=3) == 2
    assert threads.intra_op_threads(None, local_ranks=16) == 1
    assert threads.intra_op_threads(5, local_ranks=3) == 5


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        EngineConfig(threads=0)


def test_runner_runs_with_the_configured_threads_and_restores_them(tiny_qwen2_dir):
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    config = EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", num_kv_blocks=4, threads=wanted)
    runner = ModelRunner(config)
    try:
        assert torch.get_num_threads() == wanted
    finally:
        runner.shutdown()
    assert torch.get_num_threads() == before


def test_importing_kvserve_bounds_openmp_spinning():
    """Set before torch loads the OpenMP runtime; a wait policy or spin count the user chose is kept."""
    code = ("import os, kvserve.engine.llm, torch; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def run(**extra):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                             text=True, check=True)
        return out.stdout.split()[-2:]

    assert run() == ["None", "30000"]
    assert run(OMP_WAIT_POLICY="PASSIVE") == ["PASSIVE", "None"]
    assert run(GOMP_SPINCOUNT="50") == ["None", "50"]
