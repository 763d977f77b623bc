"""Run ``kvserve serve`` as a child process on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.clients.client import Client

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_HEALTH_PORT = re.compile(r"health checks \(.*\) on (\S+):(\d+)")


def stop_child(proc: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM and wait (SIGKILL if it hangs); returns the exit status (None: never started)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerProcess:
    """``with ServerProcess("--dtype", "float32") as srv: Client(srv.target)...``

    The server listens on 127.0.0.1 on a port the OS picks (``--port 0``); its log goes to a
    file (``log_text()``), so a chatty server can never block on a full pipe.
    """

    def __init__(self, *flags: str, env: dict[str, str] | None = None, client_options: dict | None = None):
        """``client_options``: ``Client`` keywords for reaching it (TLS credentials, API key)."""
        self.flags = list(flags)
        self.env = env
        self.client_options = client_options or {}
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.health_port: int | None = None  # --health-port's, printed before the listening line
        fd, path = tempfile.mkstemp(prefix="kvserve-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def health_target(self) -> str:
        """host:port of the plaintext health port (``--health-port``); LookupError without one."""
        if self.health_port is None:
            raise LookupError("the server opened no health port (--health-port)")
        return f"127.0.0.1:{self.health_port}"

    def start(self, timeout: float = 600.0) -> ServerProcess:
        """Start, then wait until it listens and its health check answers SERVING (stopped again
        if it does not)."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop(timeout=30)
            raise

    def _start(self, timeout: float) -> ServerProcess:
        cmd = [sys.executable, "-m", "kvserve", "serve", "--host", "127.0.0.1", "--port", "0",
               *self.flags]
        env = {**os.environ, **(self.env or {})}
        with open(self.log_path, "wb") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + timeout
        while self.port is None:
            self._check_alive()
            text = self.log_text()
            m = _LISTENING.search(text)
            if m:
                self.port = int(m.group(2))
                health = _HEALTH_PORT.search(text)
                self.health_port = int(health.group(2)) if health else None
            elif time.monotonic() > end:
                raise TimeoutError(f"server did not listen within {timeout} s:\n{self.log_tail()}")
            else:
                time.sleep(0.1)
        with Client(self.target, **self.client_options) as client:
            while True:
                self._check_alive()
                try:
                    client.wait_ready(timeout=2.0)
                    return self
                except TimeoutError:
                    if time.monotonic() > end:
                        tail = self.log_tail()
                        raise TimeoutError(f"server not SERVING within {timeout} s:\n{tail}") from None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 120.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 120.0) -> int | None:
        return stop_child(self.proc, timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with status {self.proc.returncode}:\n{self.log_tail()}")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
