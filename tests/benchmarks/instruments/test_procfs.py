"""benchmarks/instruments/procfs.py: a process's descendants, their CPU time, a zombie counted as gone and a
process whose main thread is a zombie counted as alive while another thread runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvserve.benchmarks.instruments.procfs import (
    alive,
    children,
    process_tree,
    process_tree_cpu_s,
    scheduled_cpu_s,
    stat,
)

# a child that starts a grandchild, says its pid, and sleeps
PARENT = ("import subprocess, sys, time\n"
          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(p.pid, flush=True)\n"
          "time.sleep(60)\n")


def test_tree_holds_children_and_grandchildren_and_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        assert children(child.pid) == [grandchild]
        assert process_tree(child.pid) == [child.pid, grandchild]
        assert alive(child.pid) and alive(grandchild)
        def both() -> float:  # the two processes' CPU seconds, read one by one
            return (stat(child.pid).cpu_ticks + stat(grandchild).cpu_ticks) / os.sysconf("SC_CLK_TCK")

        before = both()
        tree = process_tree_cpu_s(child.pid)
        assert before <= tree <= both()  # the grandchild's share included (ticks only grow)
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.send_signal(signal.SIGKILL)  # not reaped: a zombie until wait()
    deadline = time.monotonic() + 10
    while stat(child.pid).state != "Z":
        assert time.monotonic() < deadline, stat(child.pid)
        time.sleep(0.01)
    assert not alive(child.pid)
    child.wait()
    child.stdout.close()
    assert stat(child.pid) is None and not alive(child.pid)


# a child whose main thread ends (pthread_exit) while a second thread sleeps on: its main thread
# shows "Z" in /proc/PID/stat, yet the process runs and holds its files
LEADER_GONE = ("import ctypes, threading, time\n"
               "threading.Thread(target=time.sleep, args=(60,)).start()\n"
               "print('up', flush=True)\n"
               "ctypes.CDLL(None).pthread_exit(None)\n")


def test_a_process_whose_main_thread_shows_z_is_alive_while_another_thread_runs():
    """A killed multi-threaded process shows "Z" for its main thread before its other threads are
    gone; until they are, a pipe to it still takes writes and its parent cannot reap it. Counting it
    dead then let the structured-output test send a compile to a dying compiler."""
    child = subprocess.Popen([sys.executable, "-c", LEADER_GONE], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        deadline = time.monotonic() + 30
        while stat(child.pid).state != "Z":
            assert time.monotonic() < deadline, stat(child.pid)
            time.sleep(0.01)
        assert child.poll() is None  # not reapable: it runs
        assert alive(child.pid)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert not alive(child.pid)


def test_scheduled_cpu_counts_a_busy_process_and_not_a_sleeping_one():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # both started
        before = scheduled_cpu_s([busy.pid]), scheduled_cpu_s([idle.pid])
        # however loaded the machine, the busy loop is scheduled sooner or later: wait for its
        # CPU time to grow rather than assume a share of a fixed wall time
        deadline = time.monotonic() + 60
        while scheduled_cpu_s([busy.pid]) - before[0] < 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy_s, idle_s = scheduled_cpu_s([busy.pid]) - before[0], scheduled_cpu_s([idle.pid]) - before[1]
        assert busy_s >= 0.1 and idle_s < 0.05
        assert scheduled_cpu_s([busy.pid, idle.pid]) >= scheduled_cpu_s([busy.pid])
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
