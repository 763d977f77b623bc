"""What the server and its clients agree on outside llm.proto: how an API key travels.

The server (``kvserve serve --api-key``) and every client (``kvserve generate``, the Python
clients) read the same environment variable when no flag is given, and the key rides in the
``authorization`` metadata as ``Bearer <key>``. Both sides import these names from here, so
neither the service nor the clients import the other.
"""

from __future__ import annotations

import os

API_KEY_ENV = "KVSERVE_API_KEY"  # the server's and the clients' key when no --api-key is given
AUTHORIZATION = "authorization"  # the metadata key (gRPC metadata keys are lower case)
BEARER = "bearer "  # the value's scheme, compared case-insensitively by the server


def api_key_or_env(flag: str | None) -> str | None:
    """The API key: the flag's value when given, else $KVSERVE_API_KEY (empty = none)."""
    return flag if flag is not None else os.environ.get(API_KEY_ENV) or None


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries an API key (``authorization: Bearer <key>``), or None."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else None
