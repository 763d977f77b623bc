"""The service's front-end to the engine-core process, for asyncio code.

``AsyncEngine`` starts the engine core in a process of its own (engine/core_client.py) and
owns everything on the service's side of it: admission, tokenization, the per-request
streams, and the engine's lifecycle state. Requests are tokenized (chat templates rendered)
on a small thread pool, never on the event loop; what the handlers produce during one turn
of the loop goes to the core as one batch (engine/ipc.py), and each step's outputs come back
as one message, dispatched to the streams in one pass (one wake-up of the loop per step).

Admission: ``max_queue`` bounds the requests admitted but not yet running: those being
tokenized, those sent but not yet seen by the core, and the core's waiting queue. Beyond it
``generate`` raises ``EngineOverloaded`` at once.

Faults: if the core fails a step, dies (even by SIGKILL) or sends nothing for
``step_timeout`` seconds (a step that hangs: a stopped tensor-parallel worker), the state
becomes ``dead``, the core's whole process group is killed, and every request in flight ends
with ``EngineUnavailable``. Closing a stream before it finished aborts the request in the core.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvserve.engine.child_process import describe_exit
from kvserve.engine.config import EngineConfig
from kvserve.engine.core_client import CoreProcess
from kvserve.engine.engine_state import EngineInfo, EngineOverloaded, EngineState, EngineUnavailable
from kvserve.engine.ipc import Call, Codec, Failed, NewRequest, Ready, StepDone, ToCore
from kvserve.engine.prompts import PromptEncoder
from kvserve.engine.request_stream import RequestStream
from kvserve.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineInfo", "EngineOverloaded", "EngineState", "EngineUnavailable"]

log = logging.getLogger("kvserve.engine.async")

DEFAULT_MAX_QUEUE = 256
DEFAULT_STEP_TIMEOUT_S = 120.0  # a step (or an idle heartbeat) later than this means a stuck core
SHUTDOWN_GRACE_S = 15.0  # the core's own clean stop (it gives its workers 5 + 5 s)
EXIT_REPORT_DELAY_S = 0.2  # lets the core's own Failed message win over "it exited"
TOKENIZER_THREADS = 2


def _fresh_batch() -> ToCore:
    return ToCore(0, [], [], [])


class AsyncEngine:
    """The engine core in a child process, served to asyncio code.

    ``on_state`` is called on the event loop whenever the state changes."""

    def __init__(
        self,
        config: EngineConfig,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_state: Callable[[EngineState], None] | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        log_level: str = "info",
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 s, got {step_timeout}")
        self.config = config
        self.max_queue = max_queue
        self.step_timeout = step_timeout
        self._log_level = log_level
        self._on_state = on_state
        self._state = EngineState.LOADING
        self._error: str | None = None
        self.info: EngineInfo | None = None
        self._prompts: PromptEncoder | None = None
        self._codec = Codec()
        self._core: CoreProcess | None = None
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenize")
        self._live: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._batch = _fresh_batch()
        self._flush_scheduled = False
        self._seq = 0
        self._sent: deque[tuple[int, int]] = deque()  # (batch seq, new requests in it), not yet acked
        self._unacked = 0  # new requests the core has not acknowledged (unsent ones included)
        self._tokenizing = 0
        self._core_waiting = 0
        self._rejected = 0
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core process (it loads the model) and load the tokenizer meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._dead = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._last_heard = self._loop.time()
        self._core = CoreProcess(self.config, self._log_level)
        log.info("engine core: pid %d", self._core.pid)
        self._core.on_exit(self._loop, self._on_core_exit)
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._watch_steps())]
        self._tokenizer = self._loop.run_in_executor(self._pool, _load_tokenizer, self.config.model)

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def core_pid(self) -> int | None:
        return self._core.pid if self._core is not None else None

    @property
    def num_in_flight(self) -> int:
        return len(self._live) + self._tokenizing

    async def wait_ready(self) -> EngineState:
        """Wait until the model is loaded (or failed to load); returns the state then."""
        await self._ready.wait()
        return self._state

    async def wait_dead(self) -> None:
        """Return once the engine has failed."""
        await self._dead.wait()

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let requests in flight finish for up to ``timeout`` seconds, then
        abort the rest (their streams raise ``EngineUnavailable``). Returns how many were aborted."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._set_state(EngineState.DRAINING)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            pass
        left = len(self._live)
        reason = EngineUnavailable(
            f"server is shutting down: request aborted after the {timeout:g} s drain timeout"
        )
        for key in self._fail_streams(reason):
            self._batch.aborts.append(key)
        self._schedule_flush()
        return left

    async def shutdown(self) -> None:
        """Fail what is still in flight, stop the core (killing what does not stop), release
        everything; idempotent."""
        if self._core is None:
            return
        if self._state != EngineState.DEAD:
            self._set_state(EngineState.STOPPED)
        self._fail_streams(EngineUnavailable("the engine is stopped"))
        self._fail_calls(EngineUnavailable("the engine is stopped"))
        self._ready.set()
        self._batch.shutdown = True
        told = self._flush()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        core, self._core = self._core, None
        await core.stop(SHUTDOWN_GRACE_S if told and self._state != EngineState.DEAD else 0.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, str]] | None = None,
    ) -> RequestStream:
        """Admit, tokenize (off the loop) and submit a request; returns the stream of its outputs.

        Raises ``EngineOverloaded`` when the admission queue is full, ``EngineUnavailable`` when
        not ready, ``ValueError`` for a prompt the tokenizer or chat template refuses; errors
        found by the core's ``add_request`` come out of the stream as ``ValueError``."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        self._check_admission()
        self._tokenizing += 1
        self._idle.clear()
        try:
            ids = await self._loop.run_in_executor(self._pool, self._encode, prompt, messages)
        finally:
            self._tokenizing -= 1
            self._check_idle()
        if self._state not in (EngineState.READY, EngineState.DRAINING):
            raise EngineUnavailable(self._unavailable_reason())
        key = f"{request_id}#{next(self._ids)}"
        stream = RequestStream(key, self._release, params.n)
        self._live[key] = stream
        self._idle.clear()
        self._batch.new.append(NewRequest(key, ids, params))
        self._unacked += 1
        self._schedule_flush()
        return stream

    async def stats(self) -> dict:
        """The core's stats plus the admission fields (num_queued, max_queue, requests_rejected)."""
        stats = await self._call_core("stats")
        stats.update(num_queued=self._tokenizing + self._unacked, max_queue=self.max_queue,
                     requests_rejected=self._rejected)
        return stats

    async def model_info(self) -> dict:
        """The loaded model's facts (``LLMEngine.model_info()``) and whether it has a chat template."""
        info = await self._call_core("model_info")
        info["has_chat_template"] = bool(getattr(self._prompts.tokenizer, "chat_template", None))
        return info

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone (for logprobs); the tokenizer is loaded once ready."""
        if self._prompts is None:
            raise EngineUnavailable(self._unavailable_reason())
        return self._prompts.token_text(token_id)

    async def tokenize(self, prompt: str | None, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The token ids ``generate`` would run on (off the loop); ValueError for a bad prompt."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self._prompts is None:
            raise EngineUnavailable(self._unavailable_reason())
        return await self._loop.run_in_executor(self._pool, self._encode, prompt, messages)

    async def _call_core(self, name: str) -> dict:
        if self._state in (EngineState.LOADING, EngineState.DEAD, EngineState.STOPPED):
            raise EngineUnavailable(self._unavailable_reason())
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._batch.calls.append(Call(call_id, name))
        self._schedule_flush()
        return await future

    def _encode(self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None) -> list[int]:
        """Runs on the tokenizer pool."""
        if messages is not None:
            return self._prompts.render_chat(messages)
        return self._prompts.encode(prompt)

    def _check_admission(self) -> None:
        if self._state != EngineState.READY:
            raise EngineUnavailable(self._unavailable_reason())
        pending = self._tokenizing + self._unacked + self._core_waiting
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
            return f"the engine failed: {self._error}"
        return "the engine is stopped"

    def _release(self, key: str, finished: bool) -> None:
        """A stream closed. One that had not finished is aborted in the core."""
        if self._live.pop(key, None) is not None and not finished:
            self._batch.aborts.append(key)
            self._schedule_flush()
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._live and not self._tokenizing:
            self._idle.set()

    # ---- to the core: one batch per turn of the loop -------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> bool:
        """Send the batch gathered so far; False if there was nothing to send or no core took it."""
        self._flush_scheduled = False
        batch = self._batch
        if self._core is None or not (batch.new or batch.aborts or batch.calls or batch.shutdown):
            return False
        self._batch = _fresh_batch()
        self._seq += 1
        batch.seq = self._seq
        self._sent.append((self._seq, len(batch.new)))
        sent = self._core.send(self._codec.encode(batch))
        if not sent and not batch.shutdown:
            # only possible before the core connects or after it died: nothing can be served
            self._fail("the engine core is not connected")
        return sent

    # ---- from the core ------------------------------------------------------------------------------
    async def _receive(self) -> None:
        try:
            await self._receive_forever()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - without this channel nothing can be served
            log.exception("reading from the engine core failed")
            self._fail(f"reading from the engine core failed: {type(e).__name__}: {e}")

    async def _receive_forever(self) -> None:
        while True:
            data = await self._core.recv()
            self._last_heard = self._loop.time()
            msg = self._codec.decode_from_core(data)
            if isinstance(msg, StepDone):
                self._on_step(msg)
            elif isinstance(msg, Ready):
                await self._on_ready(msg)
            elif isinstance(msg, Failed):
                self._fail(msg.message)

    def _on_step(self, msg: StepDone) -> None:
        while self._sent and self._sent[0][0] <= msg.acked:
            self._unacked -= self._sent.popleft()[1]
        self._core_waiting = msg.num_waiting
        for r in msg.rejected:
            stream = self._live.pop(r.key, None)
            if stream is not None:
                stream.fail(ValueError(r.message))
        live = self._live
        for out in msg.outputs:
            stream = live.get(out.request_id)
            if stream is not None:
                stream.push(out)
                if stream.finished:
                    del live[out.request_id]
        for reply in msg.replies:
            future = self._calls.pop(reply.call_id, None)
            if future is not None and not future.done():
                future.set_result(reply.result)
        self._check_idle()

    async def _on_ready(self, msg: Ready) -> None:
        try:
            tokenizer = await self._tokenizer
        except Exception as e:  # noqa: BLE001 - the service cannot run without it
            self._fail(f"loading the tokenizer failed: {type(e).__name__}: {e}")
            return
        self.info = EngineInfo(msg.model_name, msg.vocab_size, msg.max_model_len, msg.config)
        self._prompts = PromptEncoder(tokenizer, msg.vocab_size, msg.max_model_len)
        self._last_heard = self._loop.time()
        if self._state == EngineState.LOADING:
            self._set_state(EngineState.READY)
        self._ready.set()

    async def _watch_steps(self) -> None:
        """Fail the engine when the core stays silent longer than ``step_timeout``."""
        while True:
            await asyncio.sleep(min(1.0, self.step_timeout / 4))
            silent = self._loop.time() - self._last_heard
            if self._state in (EngineState.READY, EngineState.DRAINING) and silent > self.step_timeout:
                self._fail(f"the engine core sent nothing for {silent:.1f} s (--step-timeout "
                           f"{self.step_timeout:g} s): a step is stuck, e.g. on a stopped or hung "
                           "tensor-parallel worker")

    def _on_core_exit(self, returncode: int) -> None:
        if self._core is None or self._state in (EngineState.STOPPED, EngineState.DEAD):
            return
        reason = f"the engine-core process (pid {self._core.pid}) {describe_exit(returncode)}"
        self._loop.call_later(EXIT_REPORT_DELAY_S, self._fail, reason)

    # ---- failure ---------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        """The engine is dead: kill the core's group, fail everything in flight, admit nothing."""
        if self._state in (EngineState.DEAD, EngineState.STOPPED):
            return
        log.error("engine failed: %s", reason)
        self._error = reason
        self._set_state(EngineState.DEAD)
        if self._core is not None:
            self._core.kill()
        error = EngineUnavailable(f"the engine failed: {reason}")
        self._fail_streams(error)
        self._fail_calls(error)
        self._ready.set()
        self._dead.set()

    def _fail_streams(self, error: EngineUnavailable) -> list[str]:
        keys = list(self._live)
        for stream in self._live.values():
            stream.fail(error)
        self._live.clear()
        self._check_idle()
        return keys

    def _fail_calls(self, error: EngineUnavailable) -> None:
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._on_state is not None:
            self._on_state(state)


def _load_tokenizer(model: str):
    from kvserve.engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))
