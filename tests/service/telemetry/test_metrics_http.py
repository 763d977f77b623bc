"""The /metrics endpoint's own server (service/telemetry/metrics_http.py), in this process: idle
and half-sent connections hold no thread and time out, the oldest half-sent connection makes
room for a new one, concurrent scrapes share one rendering, OpenMetrics and gzip are negotiated."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.service.telemetry import metrics_http
from kvserve.service.telemetry.metrics_http import MAX_CONNECTIONS, MetricsHttpServer


class SlowCollector(Collector):
    """Counts its collections; each takes ``delay`` seconds (an engine snapshot's round trip)."""

    def __init__(self, delay: float):
        self.delay, self.collections = delay, 0

    def collect(self):
        self.collections += 1
        time.sleep(self.delay)
        family = GaugeMetricFamily("kvserve:test_value", "A value.")
        family.add_metric([], 1.0)
        yield family


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    collector = SlowCollector(0.2)
    registry.register(collector)
    server = MetricsHttpServer(registry, "127.0.0.1", 0)
    server.collector = collector
    yield server
    server.stop()


def _get(port: int, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.status, dict(r.headers), r.read()


def _half_sent(port: int, n: int) -> list[socket.socket]:
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]
    for s in socks:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
    return socks


def _closed(s: socket.socket, wait: float) -> bool:
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_idle_connections_hold_no_thread_and_scrapes_are_answered_beside_them(endpoint):
    threads = threading.active_count()
    idle = _half_sent(endpoint.port, 300)
    try:
        time.sleep(0.3)
        assert endpoint.open_connections == MAX_CONNECTIONS  # the oldest half-sent ones made room
        assert sum(_closed(s, 0.01) for s in idle[:100]) == 100
        with ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda _: _get(endpoint.port), range(64)))
        assert all(status == 200 and b"kvserve:test_value 1.0" in body for status, _, body in replies)
        assert threading.active_count() <= threads + 1  # the endpoint's render thread at most
        # 64 scrapes at once, each rendering taking 0.2 s: they shared far fewer renderings
        assert endpoint.collector.collections < 32
    finally:
        for s in idle:
            s.close()


def test_a_half_sent_request_is_closed_after_the_read_timeout(endpoint, monkeypatch):
    monkeypatch.setattr(metrics_http, "READ_TIMEOUT_S", 0.5)
    (s,) = _half_sent(endpoint.port, 1)
    try:
        assert _closed(s, 10)
    finally:
        s.close()


def test_openmetrics_and_gzip_are_negotiated_and_other_methods_refused(endpoint):
    status, headers, body = _get(endpoint.port, {"Accept": "application/openmetrics-text; version=1.0.0",
                                                 "Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert gzip.decompress(body).endswith(b"# EOF\n")
    request = urllib.request.Request(f"http://127.0.0.1:{endpoint.port}/metrics", method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 405


def test_a_port_in_use_is_an_oserror(endpoint):
    with pytest.raises(OSError):
        MetricsHttpServer(CollectorRegistry(), "127.0.0.1", endpoint.port)
