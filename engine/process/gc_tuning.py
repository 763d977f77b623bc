"""Python's cyclic garbage collector, tuned for a serving process's steady state.

A serving process allocates tens of thousands of short-lived container objects per second (each
step's outputs decoded from msgpack, each streamed message, asyncio handles), nearly all freed by
reference counting within the step that made them. CPython's default collector runs a young
collection every 700 net allocations and, every tenth of those, an older one that walks every
object that survived, the loaded tokenizer, protobuf descriptors and module state included.
Measured with ``perf`` on the front-end at concurrency 256 (tiny model, 2-core VM), the
collector was ~14% of the process's CPU, almost all of it inside the decoding of step messages,
whose objects never form cycles.

``tune_gc`` runs once, after loading: one full collection, then ``gc.freeze()`` moves everything
alive into the permanent generation (never walked again), and the young generation's threshold
rises to ``GEN0_THRESHOLD`` so that a collection finds the objects of the last few steps already
freed instead of walking the ones still in use. Cycles are still collected, just less often.

Only the processes kvserve owns call it (the front-end once the core is ready, the engine core
and the tensor-parallel workers once loaded): they load one model and keep it until they exit.
``LLMEngine`` in a user's process does not, because frozen objects are never collected: an
engine discarded later would keep its model's reference cycles, and their memory, for good.
"""

from __future__ import annotations

import functools
import gc

GEN0_THRESHOLD = 50_000  # net allocations between young collections (CPython's default: 700)


@functools.cache
def tune_gc() -> tuple[int, int, int]:
    """Freeze the objects alive now and raise the young generation's threshold; returns the
    thresholds in force (once per process; later calls only return them)."""
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0:  # 0: the user disabled collection; leave that alone
        gc.set_threshold(max(gen0, GEN0_THRESHOLD), gen1, gen2)
    return gc.get_threshold()
