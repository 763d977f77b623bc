"""The engine-core process: an ``LLMEngine`` busy with nothing but steps.

``python -m kvserve engine-core --config JSON --inbox ipc://A --outbox ipc://B
--parent-fd N`` is started by the service's front-end (engine/frontend/core_client.py) as a fresh
interpreter. It loads the engine, says ``Ready``, then loops: take every batch the front-end
sent (new requests, aborts, stop-string stops, calls), run one step, send one ``StepDone`` with
every request's delta (token ids only: the front-end detokenizes). A request that
``add_tokenized`` refuses fails alone (``Rejected``); an error in a step, or a tensor-parallel
worker's death, ends the process after a ``Failed`` message.

The process leads its own process group (its tensor-parallel workers are in it too), so the
front-end can end all of them with one signal. When the front-end dies, the end of the
``--parent-fd`` pipe tells the core, which then ends its group: nothing outlives the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import zmq

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.ipc import (
    CALLS,
    HEARTBEAT_S,
    CacheFlush,
    Codec,
    EngineStats,
    Failed,
    NewRequest,
    Ready,
    Rejected,
    Reply,
    StepDone,
    ToCore,
)
from kvserve.engine.process.child_process import watch_lifeline
from kvserve.engine.process.gc_tuning import tune_gc
from kvserve.engine.sequence import Tenancy
from kvserve.engine.structured.compile_worker import CompilerFailed
from kvserve.engine.tenancy.shares import DeadlineUnreachable, TenantLimit
from kvserve.logs import configure_logging, inherited_log_format

log = logging.getLogger("kvserve.engine.core")


class EngineCore:
    """The loop around one ``LLMEngine``; ``run`` returns when the front-end says shutdown."""

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket):
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._codec = Codec()
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._acked = 0
        self._rejected: list[Rejected] = []
        self._replies: list[Reply] = []
        self._stop = False

    def run(self) -> None:
        engine = self.engine
        while not self._stop:
            busy = engine.has_unfinished_requests()
            self._take_inputs(timeout_ms=0 if busy else int(HEARTBEAT_S * 1000))
            outputs = engine.step() if engine.has_unfinished_requests() else []
            self._rejected += [Rejected(key, str(e), rejection(e)) for key, e in engine.take_rejected()]
            if not engine.is_healthy():
                raise RuntimeError("a tensor-parallel worker died")
            # one message per turn: a step's outputs, the answers to what came in, or (idle) a heartbeat
            self._send_step(outputs)

    def _take_inputs(self, timeout_ms: int) -> bool:
        """Apply every batch waiting in the inbox (waiting up to ``timeout_ms`` for the first)."""
        if not self._poller.poll(timeout_ms):
            return False
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            self._apply(self._codec.decode_to_core(data.buffer))

    def _apply(self, batch: ToCore) -> None:
        for req in batch.new:
            try:
                # the front-end's PromptEncoder checked the ids: they are not walked again here
                self.engine.add_tokenized(req.key, req.prompt_token_ids, req.params, tenancy(req))
            except Exception as e:  # noqa: BLE001 - this request's fault alone; the engine goes on
                self.engine.tenants.refused(req.tenant, e)
                self._rejected.append(Rejected(req.key, str(e) or type(e).__name__, rejection(e)))
        for key in batch.aborts:
            self.engine.abort(key)
        for stop in batch.stops:
            self.engine.stop_choice(stop.key, stop.index)
        for call in batch.calls:
            self._replies.append(Reply(call.call_id, self._call(call.name)))
        self._acked = batch.seq
        self._stop = self._stop or batch.shutdown

    def _call(self, name: str) -> EngineStats | CacheFlush | None:
        if name not in CALLS:
            raise ValueError(f"unknown engine-core call {name!r}; known: {list(CALLS)}")
        return getattr(self.engine, name)()

    def _send_step(self, outputs) -> None:
        msg = StepDone(self._acked, self.engine.num_waiting(), outputs, self._rejected, self._replies,
                       self.engine.take_kv_events())
        self._rejected, self._replies = [], []
        self._outbox.send(self._codec.encode(msg), copy=False)


def tenancy(req: NewRequest) -> Tenancy:
    """The request's tenant, priority and deadline (on this process's monotonic clock)."""
    deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
    return Tenancy(req.tenant, req.priority, deadline)


def rejection(error: BaseException) -> str:
    """``Rejected.kind`` of an error met while queueing a request."""
    if isinstance(error, CompilerFailed):
        return "unavailable"
    if isinstance(error, TenantLimit):
        return "overloaded"
    if isinstance(error, DeadlineUnreachable):
        return "deadline"
    return "invalid"


def run_core(config: EngineConfig, inbox_addr: str, outbox_addr: str) -> int:
    """Load the engine and serve the front-end; returns the process's exit status."""
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block a step's outputs
    outbox.setsockopt(zmq.LINGER, 5000)  # the last message (Failed) still goes out at exit
    outbox.connect(outbox_addr)
    codec = Codec()
    engine = None
    try:
        from kvserve.engine.core.llm_engine import LLMEngine

        engine = LLMEngine(config, detokenize=False)  # the front-end detokenizes
        tune_gc()
        outbox.send(codec.encode(Ready(engine.model_info(), engine.config)))
        EngineCore(engine, inbox, outbox).run()
        return 0
    except BaseException as e:  # noqa: BLE001 - reported to the front-end, then the process ends
        what = "loading the engine failed" if engine is None else "the engine core failed"
        log.exception(what)
        outbox.send(codec.encode(Failed(f"{what}: {type(e).__name__}: {e}")))
        return 1
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway; the group is ended below
                log.exception("engine shutdown failed")
        inbox.close(0)
        outbox.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve engine-core",
                                     description="kvserve's engine-core process (started by the server)")
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--inbox", required=True, help="ZeroMQ address the front-end pushes to")
    parser.add_argument("--outbox", required=True, help="ZeroMQ address the front-end pulls from")
    parser.add_argument("--parent-fd", type=int, help="pipe whose EOF means the front-end died")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, inherited_log_format(), component="core")
    if args.parent_fd is not None:
        watch_lifeline(args.parent_fd, lambda: os.killpg(0, signal.SIGKILL))  # the front-end died
    return run_core(EngineConfig(**json.loads(args.config)), args.inbox, args.outbox)

