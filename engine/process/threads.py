"""How many intra-op threads a CPU engine runs, and how they wait.

- **How many**: as many as CPUs this process may really use — its affinity mask, capped by a
  cgroup CPU quota (a container given 2 CPUs of a 64-core host may use 2, not 64) — shared
  among the tensor-parallel ranks of this machine. ``threads`` (``--threads``) overrides it.
  More threads than CPUs only makes them wait for each other.
- **How they wait**: between parallel regions (each matmul, each kernel) OpenMP's worker threads
  wait for the next one. libgomp's default spins 300,000 rounds first: on a machine where another
  process also wants the cores, a spinning thread takes CPU from the sibling it waits for, and a
  step ran 50x slower here (2026-11-30). Sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) pays a
  futex wake-up per region, and on a virtual machine the woken CPU may first have to be brought
  back from idle. ``kvserve/__init__.py`` sets ``GOMP_SPINCOUNT=30000`` (unless
  ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set): a worker bridges the Python between the
  regions of one step (final norm, LM head, sampler) and sleeps between steps. From 2026-11-30
  to 2026-12-03 it was 1,000, which let a worker sleep inside a step: served on the 2-CPU VM,
  alternating runs, 1,000 against 30,000 rounds gave one stream 50.9-53.7 against 66.3-67.1
  output tok/s and 32 streams 253-259 against 295-312 (docs/deployment/security.md has the
  figures beside a busy process). The fused decode step waits between its stages on a barrier
  of its own (csrc/decode_row.c), whatever this says. The runtime reads these once, at load, so
  a program that imports torch before kvserve keeps whatever it started with.

No torch import here: the count is plain arithmetic over what the OS reports.
"""

from __future__ import annotations

import math
import os

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"
CGROUP_V1_PERIOD = "/sys/fs/cgroup/cpu/cpu.cfs_period_us"


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all CPUs where the OS cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup allows per period, or None when unlimited/unknown."""
    try:
        with open(CGROUP_V2_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(CGROUP_V1_QUOTA) as fq, open(CGROUP_V1_PERIOD) as fp:
            quota_us, period_us = int(fq.read()), int(fp.read())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """CPUs this process can use at once: affinity, capped by the cgroup quota (rounded up: a
    quota of 1.5 CPUs still runs two threads part of the time)."""
    cpus = affinity_cpus()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus


def intra_op_threads(requested: int | None, local_ranks: int = 1) -> int:
    """The thread count for one rank: ``requested`` when given, else this machine's usable CPUs
    shared evenly among its ``local_ranks`` tensor-parallel ranks."""
    if requested is not None:
        return requested
    return max(1, available_cpus() // max(1, local_ranks))
