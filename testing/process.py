"""Child processes for tests and benchmarks: ``kvserve serve`` on a free loopback port, and a pytest
run as on another x86 CPU class (``CLASSES``, ``class_env``, ``run_pytest``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvserve.clients.client import Client
from kvserve.kernels.cpu.build import MARCH_ENV, compiler, cpu_flags

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_HEALTH_PORT = re.compile(r"health checks \(.*\) on (\S+):(\d+)")


def log_file(prefix: str) -> Path:
    """A new, empty file for a child process's output (kept after the run, for a failing test): in
    ``$KVSERVE_CHILD_LOG_DIR`` where set (the test suite's session directory, which pytest prunes),
    else the system's temporary directory."""
    folder = os.environ.get("KVSERVE_CHILD_LOG_DIR") or None
    if folder:
        os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=folder)
    os.close(fd)
    return Path(path)


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
        self.log_path = log_file("kvserve-server-")

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

    @property
    def metrics_url(self) -> str:
        """The URL of its /metrics (``--metrics-port``), as its log says."""
        (line,) = [ln for ln in self.log_text().splitlines() if ln.startswith("kvserve: metrics on ")]
        return line.removeprefix("kvserve: metrics on ")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """A scrape of its /metrics: {(sample name, sorted labels but model_name): value}."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            text = r.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = dict(s.labels)
                labels.pop("model_name", None)
                samples[(s.name, tuple(sorted(labels.items())))] = s.value
        return samples

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with status {self.proc.returncode}:\n{self.log_tail()}")

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- the x86 CPU classes kvserve builds a path for, as a test on any AVX-512 machine can stand in for
# them: the C kernels built for the class's target (``KVSERVE_CPU_MARCH``), oneDNN held to its
# instruction set (``ONEDNN_MAX_CPU_ISA``), and MKL on its code paths for that class.
#
# MKL picks its kernels by vendor as well as by features: on an AMD CPU it runs its AVX2 code even
# where AVX-512 is there, and its AVX-512 float32 GEMM (what an Intel Xeon runs) rounds rows below 16
# by other kernels than larger batches (docs/serving/speculative.md). To stand in for an Intel Xeon
# on an AMD machine, ``mkl_intel_paths`` builds a two-function library, preloaded, that answers MKL's
# vendor question with "Intel" (MKL exports the question from torch's library); nothing else changes.

ROOT = Path(__file__).resolve().parents[1]  # the checkout (kvserve's root)


@dataclass(frozen=True)
class CpuClass:
    name: str
    march: str  # KVSERVE_CPU_MARCH ("native": this CPU's own)
    needs: frozenset[str]  # /proc/cpuinfo flags the build's code may use
    env: dict[str, str] = field(default_factory=dict)
    intel_mkl: bool = False  # MKL on its Intel paths (preloaded on an AMD CPU)


_AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
CLASSES = (
    # AMD Zen 4 / EPYC Genoa and Intel Cooper Lake: vdpbf16ps everywhere
    CpuClass("avx512-bf16", "native", frozenset(_AVX512 | {"avx512_bf16"})),
    # Intel Cascade Lake and Ice Lake Xeons (the cloud's most common x86): AVX-512 and VNNI without
    # BF16; cascadelake is the target both (and any later x86 with AVX-512) run
    CpuClass("avx512", "cascadelake", frozenset(_AVX512 | {"avx512_vnni"}),
             {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, intel_mkl=True),
    # AMD Zen 1-3 and Intel client cores: AVX2 with FMA, no AVX-512
    CpuClass("avx2", "x86-64-v3", frozenset({"avx2", "fma", "f16c", "bmi2"}),
             {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
)


def runs_here(cls: CpuClass) -> bool:
    """Whether this CPU runs code built for ``cls`` (x86-64, every flag it needs, a C compiler)."""
    return (os.uname().machine == "x86_64" and compiler() is not None
            and cls.needs <= set(cpu_flags().split(":", 1)[-1].split()))


def _amd() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


def mkl_intel_paths(directory: Path) -> Path:
    """A library that, preloaded, has MKL take its Intel code paths (built into ``directory``)."""
    lib = directory / "libmkl_intel_paths.so"
    if not lib.exists():
        src = directory / "mkl_intel_paths.c"
        src.write_text("int mkl_serv_intel_cpu_true(void) { return 1; }\n"
                       "int mkl_serv_intel_cpu(void) { return 1; }\n")
        subprocess.run([compiler(), "-shared", "-fPIC", "-o", str(lib), str(src)], check=True,
                       capture_output=True, timeout=60)
    return lib


def class_env(cls: CpuClass, scratch: Path) -> dict[str, str]:
    """The environment variables that run a process as on ``cls`` (``scratch``: where to build the
    MKL preload when needed)."""
    env = dict(cls.env)
    if cls.march != "native":
        env[MARCH_ENV] = cls.march
    if cls.intel_mkl and _amd():
        env["LD_PRELOAD"] = str(mkl_intel_paths(scratch))
    return env


def run_pytest(tests: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """pytest on ``tests`` (paths from the checkout's root) in a process of its own, with ``env``
    added to this one's environment, every marker selected, warnings logged to its output."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-o", "log_cli=true", "--log-cli-level=WARNING", *tests]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)
