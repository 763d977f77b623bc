"""Child processes started as fresh interpreters of kvserve's own entry points.

``multiprocessing``'s spawn re-imports the caller's main module in every child, which fails
when that module is standard input (``python - <<EOF``) and re-runs an unguarded script's
top level. kvserve starts its engine core and its tensor-parallel workers as
``python -m kvserve.engine.<module> ...`` instead (as torchrun does), passing what they
need as arguments and inherited file descriptors:

- a **lifeline**: the read end of a pipe whose write end only the parent holds; EOF on it
  means the parent died, and the child ends (``watch_lifeline``);
- **doorbells** (``PipeDoorbell``): a pipe per worker that the leader writes one byte into
  per command, where a ``multiprocessing`` semaphore would need the spawn machinery.

``Child`` wraps ``subprocess.Popen`` with the handful of ``multiprocessing.Process`` methods
that the process handles use (``exitcode``, ``sentinel``, ``join``, ``terminate``, ``kill``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable


def kvserve_command(command: str, *args: str) -> list[str]:
    """The command line of an engine child process: ``python -m kvserve worker|engine-core ...``.
    These are stable names (``kvserve.cli`` maps them to their modules), so that nothing a user,
    a manifest or a process listing sees changes when a file moves."""
    return [sys.executable, "-m", "kvserve", command, *args]


class Child:
    def __init__(self, command: str, args: list[str], pass_fds: tuple[int, ...] = (), **popen):
        cmd = kvserve_command(command, *args)
        self.popen = subprocess.Popen(cmd, pass_fds=pass_fds, **popen)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)  # readable once the process has exited

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def close(self) -> None:
        """Release the pidfd (once; the process must be reaped or of no more interest)."""
        if self.sentinel is not None:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
            self.sentinel = None


class _Pipe:
    """A pipe whose ends are handed to children: the parent closes the read end once they have
    started (only they should hold it) and the write end when done; each end closes once."""

    def __init__(self, read_fd: int | None = None, write_fd: int | None = None):
        if read_fd is None and write_fd is None:
            read_fd, write_fd = os.pipe()
        self.read_fd, self.write_fd = read_fd, write_fd

    def close_read_end(self) -> None:
        if self.read_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.read_fd = None

    def close(self) -> None:
        self.close_read_end()
        if self.write_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.write_fd)
            self.write_fd = None


class Lifeline(_Pipe):
    """The parent's end: children get ``read_fd``; closing (or dying) tells them to end."""

    def __init__(self) -> None:
        super().__init__()


def describe_exit(returncode: int) -> str:
    """How a child ended, for messages: "exited with status 1", "was killed by SIGKILL"."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def watch_lifeline(fd: int, on_parent_death: Callable[[], None]) -> None:
    """Call ``on_parent_death()`` from a daemon thread when ``fd`` (a lifeline) reaches EOF."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        on_parent_death()

    threading.Thread(target=watch, name="kvserve-lifeline", daemon=True).start()


class PipeDoorbell(_Pipe):
    """A wake-up count over a pipe: ``release`` (leader) writes a byte, ``acquire`` (worker)
    reads one. A dead worker's doorbell fails the ringing with BrokenPipeError, never hangs.
    The leader makes one (both ends); a worker opens its inherited ``read_fd``."""

    def release(self) -> None:
        os.write(self.write_fd, b"\0")

    def acquire(self) -> None:
        if not os.read(self.read_fd, 1):
            raise EOFError("the tensor-parallel leader closed the doorbell")
