"""A process and its descendants on Linux, read from ``/proc``: the serving benchmark counts the
CPU time its server's tree used, profile_step the CPU its busy neighbours took; the tests find a
server's engine processes, measure their memory, and check that none outlived it."""

from __future__ import annotations

import os
from typing import NamedTuple


class ProcStat(NamedTuple):
    """What ``/proc/PID/stat`` says of one process."""

    state: str  # R running, S sleeping, T stopped, Z zombie (exited, not yet reaped), ...
    ppid: int
    cpu_ticks: int  # user + system time, in clock ticks


def stat(pid: int) -> ProcStat | None:
    """``pid``'s stat, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
    except OSError:
        return None
    return ProcStat(fields[0], int(fields[1]), int(fields[11]) + int(fields[12]))


def alive(pid: int) -> bool:
    """``pid`` runs: some thread of it has not exited. A zombie has exited (only its exit status is
    left, for its parent to reap), but a killed process whose main thread already shows "Z" while
    its other threads are still on their way out has not: it still holds its files (a pipe to it
    still takes writes), and its parent cannot reap it yet (``waitpid`` says it runs)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # that thread is gone
        if state not in ("Z", "X"):
            return True
    return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return [p for p, s in _stats().items() if s.ppid == pid]


def named(pids: list[int], word: bytes) -> list[int]:
    """Those of ``pids`` whose command line holds ``word`` (a process's title, such as
    ``kvserve-grammar-compiler``)."""
    def cmdline(pid: int) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    return [pid for pid in pids if word in cmdline(pid)]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents before children."""
    return _tree(pid, _stats())


def process_tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants; None where
    there is no ``/proc`` (not Linux)."""
    if not os.path.isdir("/proc"):
        return None
    stats = _stats()
    return sum(stats[p].cpu_ticks for p in _tree(pid, stats) if p in stats) / os.sysconf("SC_CLK_TCK")


def scheduled_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes ``pids`` (their main threads) have been scheduled for, from
    ``/proc/PID/schedstat`` (nanoseconds, updated at scheduler ticks and switches)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _stats() -> dict[int, ProcStat]:
    """Every process's stat (one that exits while they are read is left out)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := stat(int(entry))) is not None:
            stats[int(entry)] = s
    return stats


def _tree(pid: int, stats: dict[int, ProcStat]) -> list[int]:
    tree, i = [pid], 0
    while i < len(tree):  # breadth first
        tree += [p for p, s in stats.items() if s.ppid == tree[i] and p not in tree]
        i += 1
    return tree
