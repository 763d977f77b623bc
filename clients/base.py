"""What the synchronous and the asyncio client share: the channel, the default deadline, the API
key's metadata and the stubs. Only the calls differ (plain or awaitable)."""

from __future__ import annotations

from types import ModuleType

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.clients.messages import DEFAULT_TARGET, open_channel
from kvserve.contract import auth_metadata
from kvserve.v1 import llm_pb2_grpc


class ClientBase:
    grpc_module: ModuleType  # grpc or grpc.aio: whose channel the client calls through

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        """``timeout``: default deadline in seconds for every call (None = no deadline).
        ``credentials``: for a TLS server (``tls_credentials(ca=..., cert=..., key=...)``);
        ``api_key``: for a server started with ``--api-key``."""
        self.channel = open_channel(self.grpc_module, target, credentials)
        self.timeout = timeout
        self._metadata = auth_metadata(api_key)  # sent with every call (health needs none)
        self._stub = llm_pb2_grpc.LLMServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def _call_options(self, timeout: float | None) -> dict:
        """The deadline (this call's, else the client's) and the API key's metadata."""
        return {"timeout": timeout if timeout is not None else self.timeout, "metadata": self._metadata}
