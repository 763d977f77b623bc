"""kvserve.models."""
