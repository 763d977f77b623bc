"""The Shepherd Model Gateway (``smg``, from PyPI) as a child process on 127.0.0.1 in front of
kvserve servers, for the mesh tests and the gateway benchmark: the gateway drives the servers
over vLLM's engine protocol (``grpc://`` worker URLs), fetches their tokenizer through
GetTokenizer and serves OpenAI's HTTP API.

    with Gateway([srv_a.target, srv_b.target], policy="cache_aware") as gw:
        openai.OpenAI(base_url=gw.base_url, api_key="none")...
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvserve.testing.process import ServerProcess, log_file, stop_child


def smg_command() -> list[str]:
    """The ``smg`` console script beside this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).with_name("smg")
    if here.exists():
        return [str(here)]
    found = shutil.which("smg")
    if found is None:
        raise FileNotFoundError("smg is not installed: pip install 'smg==1.13.0' (kvserve's dev extras)")
    return [found]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """``smg launch`` over ``targets`` (host:port of kvserve servers); ``.base_url`` is the
    OpenAI base URL (``http://127.0.0.1:PORT/v1``). Its log goes to a file (``log_text()``)."""

    def __init__(self, targets: list[str], policy: str = "cache_aware", *extra: str):
        self.targets = list(targets)
        self.policy = policy
        self.extra = list(extra)
        self.port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = log_file("smg-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 120.0) -> Gateway:
        cmd = [*smg_command(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *[f"grpc://{t}" for t in self.targets], "--policy", self.policy,
               "--prometheus-port", str(self.metrics_port), "--log-level", "info", *self.extra]
        env = {**os.environ, "NO_COLOR": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the gateway lists a model, has every worker and has its tokenizer (it answers 503
        until the tokenizer fetched with GetTokenizer is registered): a one-token completion of a
        one-word prompt (no full KV block, so no replica's prefix cache changes) must succeed."""
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                models = self.get_json("/v1/models")["data"]
                workers = self.get_json("/workers")
                if models and len(workers.get("workers", [])) == len(self.targets):
                    self.model = models[0]["id"]
                    probe = {"model": self.model, "prompt": "ready", "max_tokens": 1}
                    self.post_json("/v1/completions", probe)
                    return
            except (OSError, KeyError, ValueError):
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"smg not ready within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def get_json(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        """The sum of the gateway's Prometheus samples named ``name`` (0 when it has none)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def post_json(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> int | None:
        return stop_child(self.proc, 30)

    log_text = ServerProcess.log_text
    log_tail = ServerProcess.log_tail

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
