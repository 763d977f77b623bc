"""kvserve.clients: the Python client (``Client`` sync, ``AsyncClient`` asyncio) and the
client-side command line tools."""

from kvserve.clients.aio import AsyncClient
from kvserve.clients.client import Client
from kvserve.clients.messages import Completion, Delta, Timing, TokenLogprob, Usage, tls_credentials

__all__ = [
    "AsyncClient", "Client", "Completion", "Delta", "Timing", "TokenLogprob", "Usage", "tls_credentials",
]
