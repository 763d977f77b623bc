"""The front-end's handle on the engine-core process: start it, talk to it, end it.

The core starts as a fresh interpreter of kvserve's own entry point
(``python -m kvserve.engine.core_process``), so it never re-imports the caller's main module,
in a session of its own: its tensor-parallel workers join its process group, and ``kill``
ends every one of them with one signal. The front-end holds the write end of a pipe whose
read end the core watches: if the front-end dies, the core ends its group.

The sockets: the front-end binds a PUSH socket (to the core) and a PULL socket (from the core)
on ``ipc://`` paths in a private temporary directory, removed at ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvserve.engine.child_process import Lifeline
from kvserve.engine.config import EngineConfig


class CoreProcess:
    def __init__(self, config: EngineConfig, log_level: str = "info"):
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")  # mode 0700: only this user reaches the sockets
        inbox, outbox = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._sender = self._ctx.socket(zmq.PUSH)
        self._sender.setsockopt(zmq.SNDHWM, 0)  # the core takes everything; never drop a request
        self._sender.setsockopt(zmq.LINGER, 0)
        self._sender.bind(inbox)
        self._actx = zmq.asyncio.Context()
        self._receiver = self._actx.socket(zmq.PULL)
        self._receiver.setsockopt(zmq.RCVHWM, 0)
        self._receiver.bind(outbox)
        self._lifeline = Lifeline()
        read_end = self._lifeline.read_fd
        cmd = [sys.executable, "-m", "kvserve.engine.core_process", "--config",
               json.dumps(dataclasses.asdict(config)), "--inbox", inbox, "--outbox", outbox,
               "--parent-fd", str(read_end), "--log-level", log_level]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(read_end,), start_new_session=True)
        except BaseException:
            self.close()
            raise
        finally:
            self._lifeline.close_read_end()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, data: bytes) -> bool:
        """Queue ``data`` for the core without blocking; False when no core is connected (it has
        not started yet, or it died), where a PUSH socket would otherwise block."""
        try:
            self._sender.send(data, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    async def recv(self) -> memoryview:
        frame = await self._receiver.recv(copy=False)
        return frame.buffer

    def on_exit(self, loop: asyncio.AbstractEventLoop, callback: Callable[[int], None]) -> None:
        """Call ``callback(returncode)`` on ``loop`` when the core process exits, however it ends."""

        def wait() -> None:
            rc = self.proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody to tell
                loop.call_soon_threadsafe(callback, rc)

        threading.Thread(target=wait, name="kvserve-core-exit-watch", daemon=True).start()

    def kill(self) -> None:
        """SIGKILL the core and everything in its process group (its tensor-parallel workers),
        stopped processes included."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the core to exit (after a shutdown message), then kill
        whatever is left of its group, and release the sockets."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await loop.run_in_executor(None, self.proc.wait, grace_s)
        self.kill()
        await loop.run_in_executor(None, self.proc.wait)
        self.close()

    def close(self) -> None:
        self._lifeline.close()
        self._sender.close(0)
        self._receiver.close(0)
        self._ctx.term()
        self._actx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
