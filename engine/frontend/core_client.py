"""The front-end's link to the engine-core process: ``CoreProcess`` starts it, carries bytes to
and from it and ends it; ``CoreClient`` speaks the protocol over that (batches per loop turn,
acknowledgements, calls, heartbeat watch, exit reports).

The core starts as a fresh interpreter of kvserve's own entry point
(``python -m kvserve engine-core``), so it never re-imports the caller's main module,
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
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections import deque
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.ipc import (
    CacheFlush,
    Call,
    Codec,
    EngineStats,
    Failed,
    NewRequest,
    Ready,
    StepDone,
    StopChoice,
    ToCore,
)
from kvserve.engine.process.child_process import Lifeline, describe_exit, kvserve_command

log = logging.getLogger("kvserve.engine.async")

SHUTDOWN_GRACE_S = 15.0  # the core's own clean stop (it gives its workers 5 + 5 s)
EXIT_REPORT_DELAY_S = 0.2  # lets the core's own Failed message win over "it exited"
# a core silent this long while it owes an answer (the heartbeat is every second, a CPU step is
# bounded to half a second by default) is stalled: health says NOT_SERVING until it speaks
STALL_S = 5.0


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
        cmd = kvserve_command("engine-core", "--config", json.dumps(dataclasses.asdict(config)),
                              "--inbox", inbox, "--outbox", outbox, "--parent-fd", str(read_end),
                              "--log-level", log_level)
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


class CoreClient:
    """The link to the engine core, for asyncio code: what crosses it and when.

    - Outgoing: new requests, aborts, stop-string verdicts and calls gathered during one turn of
      the event loop go to the core as one numbered ``ToCore`` batch.
    - Incoming: each message is handed on (``on_step``, ``on_ready``, ``on_fail``); a ``StepDone``
      acknowledges the batches the core has applied, and answers calls.
    - Silence: a core that sends nothing for ``step_timeout`` seconds while ``watching()`` is
      stuck (the core heartbeats when idle); ``on_fail`` says so. Before that, one silent for
      ``STALL_S`` while it owes an answer (a batch not acknowledged, a call, a request in flight:
      ``has_work()``) is ``stalled`` (``on_stall(True)``; health says NOT_SERVING) until it speaks.
    - Exit: the core's process ending is reported through ``on_fail`` (a moment later, so that
      the core's own ``Failed`` message, when it sent one, is the reason given); after ``kill``
      or ``close`` too: the owner, which ended it, ignores that (``AsyncEngine`` is dead or
      stopped by then).
    """

    def __init__(self, config: EngineConfig, log_level: str, step_timeout: float,
                 on_step: Callable[[StepDone], None], on_ready: Callable[[Ready], Awaitable[None]],
                 on_fail: Callable[[str], None], watching: Callable[[], bool],
                 has_work: Callable[[], bool] = lambda: False,
                 on_stall: Callable[[bool], None] = lambda _: None):
        self._config, self._log_level, self.step_timeout = config, log_level, step_timeout
        self._on_step, self._on_ready, self._on_fail, self._watching = on_step, on_ready, on_fail, watching
        self._has_work, self._on_stall = has_work, on_stall
        self.stalled = False
        self._codec = Codec()
        self._process: CoreProcess | None = None
        self._batch = _fresh_batch()
        self._flush_scheduled = False
        self._seq = 0
        self._sent: deque[tuple[int, int]] = deque()  # (batch seq, new requests in it), not yet acked
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start the core process (it loads the model) and listen to it."""
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()
        self._process = CoreProcess(self._config, self._log_level)
        log.info("engine core: pid %d", self._process.pid)
        self._process.on_exit(self._loop, self._exited)
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch())]

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def unacked(self) -> int:
        """New requests the core has not acknowledged yet (those not even sent included)."""
        return len(self._batch.new) + sum(n for _, n in self._sent)

    # ---- to the core ------------------------------------------------------------------------------
    def add(self, request: NewRequest) -> None:
        self._batch.new.append(request)
        self._schedule_flush()

    def abort(self, key: str) -> None:
        self._batch.aborts.append(key)
        self._schedule_flush()

    def stop_choice(self, stop: StopChoice) -> None:
        self._batch.stops.append(stop)
        self._schedule_flush()

    async def call(self, name: str) -> EngineStats | CacheFlush | None:
        """The core's answer to ``name`` (one of ``ipc.CALLS``), from its next step."""
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._batch.calls.append(Call(call_id, name))
        self._schedule_flush()
        return await future

    def _fail_calls(self, error: Exception) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> bool:
        """Send the batch gathered so far; False if there was nothing to send or no core took it."""
        self._flush_scheduled = False
        batch = self._batch
        if self._process is None or not (batch.new or batch.aborts or batch.calls or batch.stops
                                         or batch.shutdown):
            return False
        self._batch = _fresh_batch()
        self._seq += 1
        batch.seq = self._seq
        if batch.new:  # aborts, stops and calls alone add nothing to ``unacked``
            self._sent.append((self._seq, len(batch.new)))
        sent = self._process.send(self._codec.encode(batch))
        if not sent and not batch.shutdown:
            # only possible before the core connects or after it died: nothing can be served
            self._on_fail("the engine core is not connected")
        return sent

    # ---- from the core ----------------------------------------------------------------------------
    async def _receive(self) -> None:
        try:
            while True:
                data = await self._process.recv()
                self._last_heard = self._loop.time()
                if self.stalled:
                    self._set_stalled(False)
                msg = self._codec.decode_from_core(data)
                if isinstance(msg, StepDone):
                    self._step_done(msg)
                elif isinstance(msg, Ready):
                    await self._on_ready(msg)
                    self._last_heard = self._loop.time()  # the front-end's loading is not the core's silence
                elif isinstance(msg, Failed):
                    self._on_fail(msg.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - without this channel nothing can be served
            log.exception("reading from the engine core failed")
            self._on_fail(f"reading from the engine core failed: {type(e).__name__}: {e}")

    def _step_done(self, msg: StepDone) -> None:
        while self._sent and self._sent[0][0] <= msg.acked:
            self._sent.popleft()
        self._on_step(msg)
        for reply in msg.replies:
            future = self._calls.pop(reply.call_id, None)
            if future is not None and not future.done():
                future.set_result(reply.result)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.step_timeout / 4))
            silent = self._loop.time() - self._last_heard
            owed = bool(self._sent or self._calls) or self._has_work()
            if not self.stalled and self._watching() and owed and silent > STALL_S:
                self._set_stalled(True, silent)
            if self._watching() and silent > self.step_timeout:
                self._on_fail(f"the engine core sent nothing for {silent:.1f} s (--step-timeout "
                              f"{self.step_timeout:g} s): a step is stuck, e.g. on a stopped or hung "
                              "tensor-parallel worker")

    def _set_stalled(self, stalled: bool, silent: float = 0.0) -> None:
        self.stalled = stalled
        if stalled:
            log.warning("the engine core owes an answer and has sent nothing for %.1f s: not serving "
                        "until it does", silent)
        else:
            log.warning("the engine core answers again: serving")
        self._on_stall(stalled)

    def _exited(self, returncode: int) -> None:
        if self._process is None:
            return
        reason = f"the engine-core process (pid {self._process.pid}) {describe_exit(returncode)}"
        self._loop.call_later(EXIT_REPORT_DELAY_S, self._on_fail, reason)

    # ---- the end ----------------------------------------------------------------------------------
    def kill(self, error: Exception) -> None:
        """The core failed: the calls waiting on it raise ``error``; SIGKILL its process group."""
        self._fail_calls(error)
        if self._process is not None:
            self._process.kill()

    async def close(self, error: Exception, graceful: bool) -> None:
        """The calls still waiting raise ``error``; tell the core to shut down (``graceful``: and
        wait up to ``SHUTDOWN_GRACE_S`` for it), kill what is left of its group, release the
        sockets; idempotent."""
        self._fail_calls(error)
        if self._process is None:
            return
        self._batch.shutdown = True
        told = self._flush()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        process, self._process = self._process, None
        await process.stop(SHUTDOWN_GRACE_S if told and graceful else 0.0)


def _fresh_batch() -> ToCore:
    return ToCore(0, [], [], [], [])
