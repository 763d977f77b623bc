"""What the benchmarks measure with: the machine's ceiling (``ceiling``: matmul-only time, memory
bandwidth), CPU time of a process tree (``procfs``) and timed engine steps (``engine_steps``).
"""
