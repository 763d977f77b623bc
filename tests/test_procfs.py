"""benchmarks/procfs.py: a process's descendants, their CPU time, and a zombie counted as gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvserve.benchmarks.procfs import alive, children, process_tree, process_tree_cpu_s, stat

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
        own = stat(child.pid).cpu_ticks / os.sysconf("SC_CLK_TCK")
        assert process_tree_cpu_s(child.pid) >= own  # and the grandchild's
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
