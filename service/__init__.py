"""kvserve.service."""
