"""The GPU path checked without a GPU: every Triton kernel the engine launches, compiled for
sm_80, sm_89 and sm_90 at the configurations ``kvserve.kernels.triton.launch`` gives the
launchers, with registers, spills and shared memory read from the cubin and an H200 roofline
time per kernel. ``python -m kvserve.benchmarks.gpu_compile`` (docs/performance/gpu_compile.md).
"""
