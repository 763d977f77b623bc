"""The serving benchmark (``python -m kvserve.benchmarks.serving`` or ``kvserve bench``): the
workload and the gRPC load generator (``load``), the run's figures (``report``), the concurrency
sweep (``sweep``), the command (``bench``) and the floor of one message per token through Python
gRPC (``floor``).
"""
