"""kvserve.v1."""
