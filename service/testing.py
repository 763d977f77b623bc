"""A pytest plugin with one kvserve server per test session, shared by the service test modules
(``pytest_plugins = ["kvserve.service.testing"]``), so that the model is loaded once.

The server runs the default model in float32 (greedy tokens then equal the offline engine's
in float32) with a small KV cache.
"""

from __future__ import annotations

import pytest

from kvserve.service.process import ServerProcess

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
