"""kvserve.kernels."""
