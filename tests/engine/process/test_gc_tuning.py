"""The serving processes' collector settings (engine/process/gc_tuning.py), run in a fresh interpreter:
tune_gc changes process-wide state that the test process itself must keep."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from kvserve.engine.process.gc_tuning import GEN0_THRESHOLD, tune_gc

class Node:
    pass

before = gc.get_threshold()
alive = [Node() for _ in range(1000)]
thresholds = tune_gc()
assert thresholds == (GEN0_THRESHOLD, before[1], before[2]), thresholds
assert gc.get_freeze_count() >= len(alive)  # what was alive at start-up is out of reach
assert tune_gc() == thresholds  # once per process
# cycles made later are still collected
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
assert gc.collect() >= 2
gc.set_threshold(0)
"""

DISABLED = """
import gc
gc.set_threshold(0)
from kvserve.engine.process import gc_tuning
assert gc_tuning.tune_gc()[0] == 0  # a user who turned collection off keeps it off
"""


def test_tune_gc_freezes_start_up_objects_and_raises_the_young_threshold():
    subprocess.run([sys.executable, "-c", SCRIPT], check=True, timeout=60)


def test_tune_gc_leaves_a_disabled_collector_alone():
    subprocess.run([sys.executable, "-c", DISABLED], check=True, timeout=60)
