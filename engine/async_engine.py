"""The bridge between asyncio (the gRPC service) and the engine thread.

One dedicated thread owns the ``LLMEngine`` and is the only code that touches it. Handlers
on the event loop hand requests over through a thread-safe inbox and read their outputs
from a per-request ``asyncio.Queue`` that the engine thread feeds with
``loop.call_soon_threadsafe``. Nothing here blocks the event loop: admission takes a lock
that the engine thread only holds for a few list operations, never during a model step.

Admission: ``max_queue`` bounds the requests admitted but not yet running (the inbox plus
the scheduler's waiting queue). Beyond it ``generate`` raises ``EngineOverloaded`` at once.

Closing a request's output stream before it finished (the RPC was cancelled or its deadline
passed) aborts the request in the engine at the start of the next loop iteration, which
frees its KV blocks. If the engine raises, every request in flight fails with
``EngineUnavailable`` and the state becomes ``dead``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.config import EngineConfig
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine.async")

DEFAULT_MAX_QUEUE = 256
IDLE_HEALTH_CHECK_S = 1.0  # an idle engine thread wakes this often to check its workers


class EngineOverloaded(Exception):
    """The admission queue is full; the caller should retry later."""


class EngineUnavailable(Exception):
    """The engine is loading, draining, stopped or dead."""


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # finishing what it has, admitting nothing new
    DEAD = "dead"  # the engine raised; nothing will run again
    STOPPED = "stopped"


@dataclass
class EngineInfo:
    """Immutable facts about the loaded engine, readable from any thread."""

    model_name: str
    vocab_size: int
    max_model_len: int
    config: EngineConfig


@dataclass
class _NewRequest:
    key: str  # unique engine-side id; the client's request_id may repeat
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    sink: _Sink


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    sink: _Sink


@dataclass
class _Work:
    new: list[_NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    abort_all: EngineUnavailable | None = None
    stop: bool = False


class _Sink:
    """Where the engine thread puts one request's outputs (or one call's result) for the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class RequestStream:
    """Async iterator over one request's ``RequestOutput`` deltas, ending after the finished one.

    ``close()`` (also run when the consumer is cancelled while waiting) aborts the request in
    the engine if it has not finished yet.
    """

    def __init__(self, bridge: AsyncEngine, key: str, sink: _Sink):
        self._bridge = bridge
        self._key = key
        self._sink = sink
        self._done = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            self.close()
            raise StopAsyncIteration
        try:
            item = await self._sink.queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            self.close()
            raise item
        if item.finished:
            self._done = True
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._bridge._release(self._key, aborted=not self._done)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncEngine:
    """Runs an ``LLMEngine`` in its own thread and serves it to asyncio code.

    ``engine`` is an ``EngineConfig`` (the model is loaded in the engine thread, so the
    service can answer health checks while it loads, and ``shutdown`` shuts it down) or an
    already built ``LLMEngine`` (its owner shuts it down; it must not be used elsewhere
    while this bridge runs). ``on_state`` is called on the event loop whenever the state changes.
    """

    def __init__(
        self,
        engine: EngineConfig | Any,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_state: Callable[[EngineState], None] | None = None,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self._source = engine
        self._owns_engine = isinstance(engine, EngineConfig)
        self._on_state = on_state
        self._cond = threading.Condition()
        self._inbox: deque[_NewRequest] = deque()
        self._work = _Work()
        self._in_transit = 0  # taken from the inbox, not yet counted by engine.num_waiting()
        self._waiting = 0  # engine.num_waiting() as of the engine thread's last look
        self._rejected = 0
        self._state = EngineState.LOADING
        self._error: BaseException | None = None
        self._keys = itertools.count()
        self._live_keys: set[str] = set()  # loop thread: requests whose stream is open
        self._idle: asyncio.Event | None = None
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.info: EngineInfo | None = None

    # ---- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (it loads the model first when given a config)."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._ready = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_in_flight(self) -> int:
        return len(self._live_keys)

    async def wait_ready(self) -> EngineState:
        """Wait until the model is loaded (or failed to load); returns the state then."""
        await self._ready.wait()
        return self._state

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let requests in flight finish for up to ``timeout`` seconds, then
        abort the rest (their streams raise ``EngineUnavailable``). Returns how many were aborted."""
        self._set_state(EngineState.DRAINING, only_from=(EngineState.READY, EngineState.LOADING))
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            pass
        left = self.num_in_flight
        reason = EngineUnavailable(
            f"server is shutting down: request aborted after the {timeout:g} s drain timeout"
        )
        with self._cond:
            self._work.abort_all = reason
            self._cond.notify()
        return left

    async def shutdown(self) -> None:
        """Stop the engine thread and the engine (idempotent)."""
        with self._cond:
            self._work.stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- requests (event loop) ----------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, str]] | None = None,
    ) -> RequestStream:
        """Admit a request and return the stream of its outputs.

        Raises ``EngineOverloaded`` when the admission queue is full and ``EngineUnavailable``
        when not ready; errors found by the engine (``ValueError``) come out of the stream.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        key = f"{request_id}#{next(self._keys)}"
        sink = _Sink(self._loop)
        req = _NewRequest(key, prompt, messages, params, sink)
        with self._cond:
            self._check_admission()
            self._inbox.append(req)
            self._cond.notify()
        self._live_keys.add(key)
        self._idle.clear()
        return RequestStream(self, key, sink)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        sink = _Sink(self._loop)
        with self._cond:
            if self._state in (EngineState.LOADING, EngineState.DEAD, EngineState.STOPPED):
                raise EngineUnavailable(self._unavailable_reason())
            self._work.calls.append(_Call(fn, sink))
            self._cond.notify()
        result = await sink.queue.get()
        if isinstance(result, BaseException):
            raise result
        return result

    async def stats(self) -> dict:
        """The engine's stats plus the admission fields (num_queued, max_queue, requests_rejected)."""
        return await self.call(self._stats_in_thread)

    def _check_admission(self) -> None:
        """Called with the lock held."""
        if self._state != EngineState.READY:
            raise EngineUnavailable(self._unavailable_reason())
        pending = len(self._inbox) + self._in_transit + self._waiting
        if pending >= self.max_queue:
            self._rejected += 1
            raise EngineOverloaded(
                f"admission queue is full: {pending} requests waiting to run "
                f"(--max-queue {self.max_queue}); retry later"
            )

    def _unavailable_reason(self) -> str:
        if self._state == EngineState.LOADING:
            return "the model is still loading"
        if self._state == EngineState.DRAINING:
            return "server is shutting down (draining); not accepting new requests"
        if self._state == EngineState.DEAD:
            return f"the engine failed: {self._error!r}"
        return "the engine is stopped"

    def _release(self, key: str, aborted: bool) -> None:
        """A stream closed (loop thread). An unfinished request is aborted in the engine."""
        self._live_keys.discard(key)
        if not self._live_keys:
            self._idle.set()
        if not aborted:
            return
        with self._cond:
            for i, req in enumerate(self._inbox):
                if req.key == key:  # never reached the engine
                    del self._inbox[i]
                    return
            self._work.aborts.append(key)
            self._cond.notify()

    def _set_state(self, state: EngineState, only_from: tuple[EngineState, ...] | None = None) -> None:
        with self._cond:
            if only_from is not None and self._state not in only_from:
                return
            self._state = state
        if self._on_state is not None:
            self._loop.call_soon_threadsafe(self._on_state, state)

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as e:  # noqa: BLE001 - any load failure makes the engine dead
            log.exception("loading the engine failed")
            self._fail(e)
            self._fail_pending({}, e)
            self._loop.call_soon_threadsafe(self._ready.set)
            return
        self._set_state(EngineState.READY, only_from=(EngineState.LOADING,))
        self._loop.call_soon_threadsafe(self._ready.set)
        live: dict[str, _Sink] = {}
        error = None
        try:
            self._loop_until_stopped(engine, live)
        except BaseException as e:  # noqa: BLE001 - fail every request, then report
            log.exception("the engine loop failed")
            error = e
            self._fail(e)
        self._close(engine, live, error)

    def _load(self):
        if isinstance(self._source, EngineConfig):
            from kvserve.engine.llm_engine import LLMEngine

            engine = LLMEngine(self._source)
        else:
            engine = self._source
        cfg = engine.config
        self.info = EngineInfo(engine.model_name, engine.vocab_size, cfg.max_model_len, cfg)
        return engine

    def _loop_until_stopped(self, engine, live: dict[str, _Sink]) -> None:
        while True:
            work = self._next_work(engine)
            if work.stop:
                return
            for c in work.calls:
                self._run_call(engine, c)
            if work.abort_all is not None:
                self._abort_all(engine, live, work.new, work.abort_all)
                work.new = []
            for key in work.aborts:
                if live.pop(key, None) is not None:
                    engine.abort(key)
            for req in work.new:
                self._add(engine, req, live)
            self._publish_waiting(engine)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self._publish_waiting(engine)  # before the outputs wake anyone who then admits more
                self._deliver(outputs, live)
                if not engine.is_healthy():
                    raise RuntimeError("a tensor-parallel worker died")

    def _next_work(self, engine) -> _Work:
        """Sleep until there is something to do; take it all (the inbox moves into ``new``)."""
        with self._cond:
            while not (self._inbox or self._has_work() or engine.has_unfinished_requests()):
                if not self._cond.wait(IDLE_HEALTH_CHECK_S) and not engine.is_healthy():
                    raise RuntimeError("a tensor-parallel worker died")
            work, self._work = self._work, _Work(stop=self._work.stop)
            work.new = list(self._inbox)
            self._inbox.clear()
            self._in_transit = len(work.new)
            return work

    def _has_work(self) -> bool:
        w = self._work
        return bool(w.aborts or w.calls or w.abort_all or w.stop)

    def _publish_waiting(self, engine) -> None:
        with self._cond:
            self._waiting = engine.num_waiting()
            self._in_transit = 0

    def _add(self, engine, req: _NewRequest, live: dict[str, _Sink]) -> None:
        try:
            prompt = req.prompt if req.messages is None else engine.apply_chat_template(req.messages)
            engine.add_request(req.key, prompt, req.params)
        except ValueError as e:  # the user's mistake: the stream raises it, the engine goes on
            req.sink.put(e)
            return
        live[req.key] = req.sink

    def _deliver(self, outputs: list[RequestOutput], live: dict[str, _Sink]) -> None:
        for out in outputs:
            sink = live.pop(out.request_id, None) if out.finished else live.get(out.request_id)
            if sink is not None:
                sink.put(out)

    def _run_call(self, engine, call: _Call) -> None:
        try:
            call.sink.put(call.fn(engine))
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            call.sink.put(e)

    def _stats_in_thread(self, engine) -> dict:
        stats = engine.stats()
        with self._cond:
            stats["num_queued"] = len(self._inbox) + self._in_transit
            stats["max_queue"] = self.max_queue
            stats["requests_rejected"] = self._rejected
        return stats

    def _abort_all(self, engine, live: dict[str, _Sink], new: list[_NewRequest], reason: EngineUnavailable):
        for req in new:
            req.sink.put(reason)
        for key, sink in list(live.items()):
            engine.abort(key)
            sink.put(reason)
        live.clear()
        if engine.has_unfinished_requests():
            engine.step()  # hands out the abort outputs; nobody needs them

    def _fail(self, error: BaseException) -> None:
        """The engine is dead: nothing will be admitted again."""
        with self._cond:
            self._error = error
        self._set_state(EngineState.DEAD)

    def _fail_pending(self, live: dict[str, _Sink], error: BaseException | None) -> None:
        """Every request and call in flight or queued gets UNAVAILABLE."""
        with self._cond:
            pending = [r.sink for r in self._inbox] + [c.sink for c in self._work.calls]
            self._inbox.clear()
            self._work.calls.clear()
        reason = EngineUnavailable(f"the engine failed: {error!r}" if error else "the engine is stopped")
        for sink in pending + list(live.values()):
            sink.put(reason)

    def _close(self, engine, live: dict[str, _Sink], error: BaseException | None) -> None:
        """Fail what is left, abort it in the engine, and shut the engine down if it is ours."""
        self._fail_pending(live, error)
        for key in live:
            with contextlib.suppress(Exception):  # a broken engine may refuse; nothing else to do
                engine.abort(key)
        live.clear()
        if error is None:
            self._set_state(EngineState.STOPPED, only_from=(EngineState.READY, EngineState.DRAINING))
        try:
            if self._owns_engine:
                engine.shutdown()
            elif engine.has_unfinished_requests():
                engine.step()  # hands out the abort outputs, leaving the borrowed engine clean
        except Exception:  # noqa: BLE001 - stopping anyway
            log.exception("engine shutdown failed")
