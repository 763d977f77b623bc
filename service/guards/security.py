"""Who may talk to the server: TLS / mutual TLS credentials, the API key, reflection on or off.

- ``--tls-cert`` / ``--tls-key`` (PEM files) serve over TLS; with ``--tls-client-ca`` too, a
  client must present a certificate signed by that CA (mutual TLS).
- ``--api-key`` (or the environment variable ``KVSERVE_API_KEY``, which keeps the key out of
  ``ps``): every call except the health service must carry the metadata
  ``authorization: Bearer <key>``; the key is compared in constant time; anything else ends
  the call with UNAUTHENTICATED. Health stays open so that load balancers and orchestrators
  can probe without the key, and so does reflection: it serves the schema (the public .proto),
  no data, and grpcurl resolves even ``grpc.health.v1.Health/Check`` through it. A method the
  server does not have is UNIMPLEMENTED with or without the key (grpcurl asks for reflection v1
  first and falls back to v1alpha only on UNIMPLEMENTED).
- ``--no-reflection`` turns server reflection off (it describes the whole API to anyone).
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvserve.contract import API_KEY_ENV, AUTHORIZATION, BEARER, api_key_or_env
from kvserve.service.guards.interceptors import GuardedHandlers, guarded, refuse
from kvserve.service.methods import HEALTH_SERVICE, REFLECTION_SERVICE, split_method

log = logging.getLogger("kvserve.service")

KV_EVENTS_KEY_ENV = "KVSERVE_KV_EVENTS_KEY"
KV_EVENTS_KEY_HEADER = "x-kv-events-key"

# callable without the key: probes, and the schema (not data)
OPEN_SERVICES = frozenset({HEALTH_SERVICE.full_name, REFLECTION_SERVICE.full_name})


@dataclass(frozen=True)
class SecuritySettings:
    tls_cert: str | None = None  # PEM certificate chain
    tls_key: str | None = None  # PEM private key
    tls_client_ca: str | None = None  # PEM CA bundle; set = clients must present a certificate
    api_key: str | None = None
    reflection: bool = True
    kv_events_key: str | None = None  # what SubscribeKvEvents needs beside the API key

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key: give both (or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca: needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key: must not be empty")
        if self.kv_events_key is not None and not self.kv_events_key.strip():
            raise ValueError("--kv-events-key: must not be empty")

    def kv_events_refusal(self, metadata) -> str | None:
        """Why this caller may not read KV-cache events (they carry every tenant's prompt token
        ids), or None. With --kv-events-key the call must carry it; with only --api-key nobody may
        (a key holder is a tenant, not the operator); an open server is open."""
        if self.kv_events_key is None:
            if self.api_key is None:
                return None
            return ("KV-cache events carry every tenant's prompt token ids: with --api-key they are read "
                    f"only with --kv-events-key, sent as '{KV_EVENTS_KEY_HEADER}: KEY'")
        values = [v for k, v in metadata or () if k == KV_EVENTS_KEY_HEADER]
        given = values[0] if values else b""
        given = given.encode() if isinstance(given, str) else given
        if not hmac.compare_digest(given, self.kv_events_key.encode()):  # constant time
            return f"SubscribeKvEvents needs the --kv-events-key in the '{KV_EVENTS_KEY_HEADER}' metadata"
        return None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security")
    g.add_argument("--tls-cert", metavar="PEM", help="serve over TLS with this certificate chain")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert (give both)")
    g.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: clients must present a certificate signed by this CA")
    # the environment is read later, so that --help (which prints defaults) never shows the key
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help=f"require 'authorization: Bearer KEY' on every call but health and reflection "
                        f"(env {API_KEY_ENV}, which keeps the key out of the process list)")
    g.add_argument("--kv-events-key", metavar="KEY", default=None,
                   help=f"SubscribeKvEvents needs '{KV_EVENTS_KEY_HEADER}: KEY' (the events carry every "
                        f"tenant's prompt token ids; with --api-key and no --kv-events-key nobody may read "
                        f"them) (env {KV_EVENTS_KEY_ENV})")
    g.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                   help="serve gRPC server reflection (--no-reflection: grpcurl then needs the .proto)")


def security_settings(args: argparse.Namespace) -> SecuritySettings:
    api_key = api_key_or_env(args.api_key)
    kv_key = args.kv_events_key
    if kv_key is None:  # the environment keeps the key out of the process list
        kv_key = os.environ.get(KV_EVENTS_KEY_ENV) or None
    return SecuritySettings(args.tls_cert, args.tls_key, args.tls_client_ca, api_key, args.reflection, kv_key)


def server_credentials(settings: SecuritySettings) -> grpc.ServerCredentials | None:
    """TLS credentials for the listening port, None for plaintext; ValueError naming the flag
    for a file that cannot be read or is not PEM."""
    if not settings.tls:
        return None
    cert = read_pem("--tls-cert", settings.tls_cert)
    key = read_pem("--tls-key", settings.tls_key)
    ca = read_pem("--tls-client-ca", settings.tls_client_ca) if settings.tls_client_ca else None
    mutual = ca is not None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=mutual)


def read_pem(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag}: {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def warn_if_exposed(settings: SecuritySettings, host: str) -> None:
    """Say so when a non-loopback address serves without TLS or without a key."""
    if host in ("127.0.0.1", "::1", "localhost"):
        return
    if not settings.tls:
        log.warning("listening on %s without TLS: prompts, completions%s travel in clear text", host,
                    " and the API key" if settings.api_key else "")
    if settings.api_key is None:
        log.warning("listening on %s without --api-key: anyone who reaches the port can use it", host)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health and reflection that lacks ``authorization: Bearer <key>``."""

    def __init__(self, api_key: str):
        self._key = api_key.encode()
        self._refusals = GuardedHandlers()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or split_method(handler_call_details.method)[0] in OPEN_SERVICES:
            return handler  # None: no such method, UNIMPLEMENTED for everyone
        problem = self._problem(handler_call_details.invocation_metadata or ())
        if problem is None:
            return handler
        # one refusing handler per (method, problem): the interceptors outside cache by handler
        return self._refusals.get(handler, problem, lambda h: guarded(h, _refuse(problem)))

    def _problem(self, metadata) -> str | None:
        """Why the call is refused, or None when it carries the key."""
        values = [v for k, v in metadata if k == AUTHORIZATION]
        if not values:
            return "missing API key: send the metadata 'authorization: Bearer <key>'"
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        if not value.lower().startswith(BEARER):
            return "the authorization metadata must be 'Bearer <key>'"
        given = value[len(BEARER):].strip().encode()
        if not hmac.compare_digest(given, self._key):  # constant time: no timing oracle
            return "invalid API key"
        return None


def _refuse(message: str):
    @asynccontextmanager
    async def unauthenticated(request, context):
        yield refuse(context, grpc.StatusCode.UNAUTHENTICATED, message)

    return unauthenticated
