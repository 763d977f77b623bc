"""A pytest plugin with one kvserve server per test session, shared by the service test modules
(``pytest_plugins = ["kvserve.testing.plugin"]``), so that the model is loaded once.

The server runs the default model in float32 (greedy tokens then equal the offline engine's
in float32) with a small KV cache. ``secure_server`` is a second one, started on first use,
with mutual TLS (certificates made for the session), an API key, no reflection and small
call limits.
"""

from __future__ import annotations

import time

import pytest

from kvserve.contract import API_KEY_ENV
from kvserve.service.health import HEALTH_PORT_ENV
from kvserve.testing.process import ServerProcess

SECURE_API_KEY = "test-key-not-secret"
SECURE_LIMITS = {"max_streams": 6, "max_streams_per_connection": 4, "max_watch_streams": 2}
SHARED_SERVER_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "0.5", "--max-queue", "64")
# One intra-op thread: the test process and the server share a small machine's cores, and
# OpenMP threads that wait for a descheduled sibling slow every step. Greedy tokens do not
# depend on it.
TEST_SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def kvserve_server():
    """The shared server (``.target`` is its host:port)."""
    with ServerProcess(*SHARED_SERVER_FLAGS, env=TEST_SERVER_ENV) as server:
        yield server
        rc = server.stop()
    assert rc == 0, f"shared server exited with status {rc}:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> dict[str, str]:
    """PEM files (see ``make_tls_files``): ca, server_cert/key, client_cert/key, rogue_cert/key."""
    from kvserve.testing.tls import make_tls_files

    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def secure_server(tls_files):
    """Mutual TLS + API key (from the environment, as in production) + no reflection + the
    small ``SECURE_LIMITS``, and a plaintext health port (any free one, from the environment, as
    the Docker image sets it). ``.client_options`` are the ``Client`` keywords that reach it."""
    from kvserve.clients import tls_credentials

    limits = [x for name, n in SECURE_LIMITS.items() for x in ("--" + name.replace("_", "-"), str(n))]
    flags = ("--tls-cert", tls_files["server_cert"], "--tls-key", tls_files["server_key"],
             "--tls-client-ca", tls_files["ca"], "--no-reflection", "--kv-cache-memory", "0.1", *limits)
    options = {
        "credentials": tls_credentials(tls_files["ca"], tls_files["client_cert"], tls_files["client_key"]),
        "api_key": SECURE_API_KEY,
    }
    env = {**TEST_SERVER_ENV, API_KEY_ENV: SECURE_API_KEY, HEALTH_PORT_ENV: "0"}
    with ServerProcess(*flags, env=env, client_options=options) as server:
        yield server
        rc = server.stop()
    assert rc == 0, f"secure server exited with status {rc}:\n{server.log_tail()}"


def wait_until_idle(client, timeout: float = 120.0) -> dict:
    """Stats (from a ``kvserve.clients.Client``) once nothing runs, waits or is queued (aborts are
    processed within one engine step); fails the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s["num_running"] == s["num_waiting"] == s["num_queued"] == 0:
            return s
        assert time.monotonic() < end, f"server still busy after {timeout} s: {s}"
        time.sleep(0.05)
