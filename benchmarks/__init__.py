"""kvserve.benchmarks."""
