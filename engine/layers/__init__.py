"""kvserve.layers."""
