"""kvserve.clients."""
