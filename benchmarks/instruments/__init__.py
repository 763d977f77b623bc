"""What the benchmarks measure with: the machine's ceiling (``ceiling``: matmul-only time, memory
bandwidth), CPU time of a process tree (``procfs``), timed engine steps (``engine_steps``) and the
engine driven in process by the peers' load pattern (``in_process``).
"""
