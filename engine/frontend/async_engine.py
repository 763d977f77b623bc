"""The service's front-end to the engine-core process, for asyncio code.

``AsyncEngine`` runs the engine core in a process of its own, through ``CoreClient``
(engine/frontend/core_client.py: the link, one batch per turn of the loop each way), and owns everything
on the service's side of it: admission, tokenization, detokenization (with stop strings: a
choice whose text holds one ends here, and the core is told to stop it), the per-request
streams, and the engine's lifecycle state. Requests are tokenized (chat templates rendered) on
a small thread pool, never on the event loop; each step's outputs come back as one message,
dispatched to the streams in one pass (one wake-up of the loop per step).

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
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.ipc import CacheFlush, NewRequest, Ready, StepDone, StopChoice
from kvserve.engine.frontend.core_client import CoreClient
from kvserve.engine.frontend.engine_state import (
    DeadlineUnmet,
    EngineInfo,
    EngineOverloaded,
    EngineState,
    EngineUnavailable,
    ServerStats,
)
from kvserve.engine.frontend.kv_events import KvEventHub
from kvserve.engine.frontend.request_stream import RequestStream
from kvserve.engine.process.gc_tuning import tune_gc
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.tokenizer.detokenizer import RequestText
from kvserve.engine.tokenizer.prompts import PromptEncoder

__all__ = ["AsyncEngine", "DeadlineUnmet", "EngineInfo", "EngineOverloaded", "EngineState",
           "EngineUnavailable"]

# the core's ``Rejected.kind`` -> the error its stream raises
REJECTED = {"invalid": ValueError, "unavailable": EngineUnavailable, "overloaded": EngineOverloaded,
            "deadline": DeadlineUnmet}

log = logging.getLogger("kvserve.engine.async")

DEFAULT_MAX_QUEUE = 256
DEFAULT_STEP_TIMEOUT_S = 120.0  # a step (or an idle heartbeat) later than this means a stuck core
TOKENIZER_THREADS = 2
INLINE_IDS = 4096  # token-id prompts up to this long are checked on the event loop (~0.2 ms at most)


class AsyncEngine:
    """The engine core in a child process, served to asyncio code.

    ``on_state`` is called on the event loop whenever the state changes, ``on_health`` with
    ``healthy`` whenever that changes (the state, or a stalled core: ``CoreClient``)."""

    def __init__(
        self,
        config: EngineConfig,
        max_queue: int = DEFAULT_MAX_QUEUE,
        on_state: Callable[[EngineState], None] | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        on_health: Callable[[bool], None] | None = None,
        log_level: str = "info",
        stream_interval: int = 1,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if step_timeout <= 0:
            raise ValueError(f"step_timeout must be > 0 s, got {step_timeout}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval  # see RequestStream
        self.config = config
        self.max_queue = max_queue
        self._on_state, self._on_health = on_state, on_health
        self._state = EngineState.LOADING
        self._error: str | None = None
        self.info: EngineInfo | None = None
        self._prompts: PromptEncoder | None = None
        self._core = CoreClient(config, log_level, step_timeout, on_step=self._on_step,
                                on_ready=self._on_ready, on_fail=self._fail, watching=self._serving,
                                has_work=lambda: bool(self._live), on_stall=lambda _: self._health_changed())
        self._started = False
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="kvserve-tokenize")
        self._live: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._tokenizing = 0
        self._core_waiting = 0
        self._rejected = 0
        # KV-cache events (engine/frontend/kv_events.py): set before start() to have them published
        self.kv_events: KvEventHub | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the core process (it loads the model) and load the tokenizer meanwhile."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._dead = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._core.start()
        self._started = True
        self._tokenizer = self._loop.run_in_executor(self._pool, _load_tokenizer, self.config.model)

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def core_pid(self) -> int | None:
        return self._core.pid

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
        reason = EngineUnavailable(
            f"server is shutting down: request aborted after the {timeout:g} s drain timeout"
        )
        keys = self._fail_streams(reason)
        for key in keys:
            self._core.abort(key)
        return len(keys)

    async def shutdown(self) -> None:
        """Fail what is still in flight, stop the core (killing what does not stop), release
        everything; idempotent."""
        if not self._started:
            return
        self._started = False
        dead = self._state == EngineState.DEAD
        if not dead:
            self._set_state(EngineState.STOPPED)
        stopped = EngineUnavailable("the engine is stopped")
        self._fail_streams(stopped)
        self._ready.set()
        await self._core.close(stopped, graceful=not dead)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams,
        messages: list[dict[str, str]] | None = None,
        tenant: str = "",
        priority: int = 0,
        deadline: float | None = None,
    ) -> RequestStream:
        """Admit, tokenize (off the loop) and submit a request; returns the stream of its outputs.
        ``tenant`` (hashed), ``priority`` (lower = earlier) and ``deadline`` (``time.monotonic()``
        seconds, None = none) order it in the core (engine/tenancy/shares.py).

        Raises ``EngineOverloaded`` when the admission queue is full, ``EngineUnavailable`` when
        not ready, ``ValueError`` for a prompt the tokenizer or chat template refuses; errors
        found by the core's ``add_request`` come out of the stream as ``ValueError``."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        self._check_admission()
        if isinstance(prompt, list) and len(prompt) <= INLINE_IDS:
            # token ids need no tokenizer: checked here, without the pool's thread hand-offs
            ids, text = self._prepare(prompt, None, params)
        else:
            self._tokenizing += 1
            self._idle.clear()
            try:
                ids, text = await self._loop.run_in_executor(self._pool, self._prepare, prompt, messages,
                                                             params)
            finally:
                self._tokenizing -= 1
                self._check_idle()
        if not self._serving():
            raise EngineUnavailable(self._unavailable_reason())
        key = f"{request_id}#{next(self._ids)}"
        stream = RequestStream(key, self._release, params.n, text, self.stream_interval)
        self._live[key] = stream
        self._idle.clear()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._core.add(NewRequest(key, ids, params, tenant, priority, timeout))
        return stream

    async def stats(self) -> ServerStats:
        """The core's stats plus the admission fields (num_queued, max_queue, requests_rejected)."""
        core = await self._call_core("stats")
        return ServerStats(**msgspec.structs.asdict(core), num_queued=self._tokenizing + self._core.unacked,
                           max_queue=self.max_queue, requests_rejected=self._rejected)

    async def reset_prefix_cache(self, wait_s: float = 0.0) -> CacheFlush:
        """Forget the core's cached prefixes, waiting up to ``wait_s`` for the requests in flight to
        end (refused while requests hold blocks)."""
        if wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), wait_s)
        return await self._call_core("reset_prefix_cache")

    async def model_info(self) -> EngineInfo:
        """The loaded model's facts (``LLMEngine.model_info()``, sent with ``Ready``) and whether it
        has a chat template; refused as the other calls are while the engine is not serving."""
        if not self._serving():
            raise EngineUnavailable(self._unavailable_reason())
        return self.info

    @property
    def tokenizer(self):
        """The front-end's tokenizer (None until the engine is ready)."""
        return self._prompts.tokenizer if self._prompts is not None else None

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
        return await self._loop.run_in_executor(self._pool, self._encode, prompt, messages, False)

    async def _call_core(self, name: str):
        if not self._serving():
            raise EngineUnavailable(self._unavailable_reason())
        return await self._core.call(name)

    def _encode(self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None,
                generate: bool = True) -> list[int]:
        """Runs on the tokenizer pool (short token-id prompts: on the loop). ``generate``: the ids
        of a request, held to max_model_len and the vocabulary (else Tokenize's, only tokenized)."""
        if messages is not None:
            return self._prompts.render_chat(messages, generate)
        return self._prompts.encode(prompt, generate)

    def _prepare(self, prompt, messages, params: SamplingParams) -> tuple[list[int], RequestText]:
        """The prompt's ids and the request's detokenizers; runs on the tokenizer pool."""
        ids = self._encode(prompt, messages)
        return ids, RequestText(self._prompts.tokenizer, ids, params)

    def _check_admission(self) -> None:
        if self._state != EngineState.READY:
            raise EngineUnavailable(self._unavailable_reason())
        pending = self._tokenizing + self._core.unacked + self._core_waiting
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
            self._core.abort(key)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._live and not self._tokenizing:
            self._idle.set()

    def _serving(self) -> bool:
        return self._state in (EngineState.READY, EngineState.DRAINING)

    # ---- from the core ------------------------------------------------------------------------------
    def _on_step(self, msg: StepDone) -> None:
        self._core_waiting = msg.num_waiting
        if msg.kv_events and self.kv_events is not None:
            self.kv_events.publish(msg.kv_events)
        for r in msg.rejected:
            stream = self._live.pop(r.key, None)
            if stream is not None:
                self._rejected += r.kind == "overloaded"  # a tenant's cap: counted as a full queue is
                stream.fail(REJECTED[r.kind](r.message))
        live = self._live
        for out in msg.outputs:
            stream = live.get(out.request_id)
            if stream is None:
                continue
            verdict = stream.text.process(out)  # the text; a stop string ends the choice here
            if verdict is RequestText.DROP:  # a token the core made before it heard of the stop
                continue
            if verdict is RequestText.STOPPED:
                self._core.stop_choice(StopChoice(out.request_id, out.index))
            stream.push(out)
            if stream.finished:
                del live[out.request_id]
        self._check_idle()

    async def _on_ready(self, msg: Ready) -> None:
        try:
            tokenizer = await self._tokenizer
        except Exception as e:  # noqa: BLE001 - the service cannot run without it
            self._fail(f"loading the tokenizer failed: {type(e).__name__}: {e}")
            return
        self.info = EngineInfo(msg.facts, msg.config, bool(getattr(tokenizer, "chat_template", None)))
        if self.kv_events is not None:  # the core collects them from its next batch on
            self._enabling = asyncio.ensure_future(self._core.call("enable_kv_events"))
        self._prompts = PromptEncoder(tokenizer, msg.facts.vocab_size, msg.config.max_model_len)
        tune_gc()  # everything the front-end loaded is in place
        if self._state == EngineState.LOADING:
            self._set_state(EngineState.READY)
        self._ready.set()

    # ---- failure ---------------------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        """The engine is dead: kill the core's group, fail everything in flight, admit nothing."""
        if self._state in (EngineState.DEAD, EngineState.STOPPED):
            return
        log.error("engine failed: %s", reason)
        self._error = reason
        self._set_state(EngineState.DEAD)
        error = EngineUnavailable(f"the engine failed: {reason}")
        self._core.kill(error)
        self._fail_streams(error)
        self._ready.set()
        self._dead.set()

    def _fail_streams(self, error: EngineUnavailable) -> list[str]:
        keys = list(self._live)
        for stream in self._live.values():
            stream.fail(error)
        self._live.clear()
        self._check_idle()
        return keys

    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._on_state is not None:
            self._on_state(state)
        self._health_changed()

    @property
    def healthy(self) -> bool:
        """Ready, and the core answers (not stalled: ``CoreClient.stalled``)."""
        return self._state == EngineState.READY and not self._core.stalled

    def _health_changed(self) -> None:
        if self._on_health is not None:
            self._on_health(self.healthy)


def _load_tokenizer(model: str):
    from kvserve.engine.model_loader.source import resolve_model
    from kvserve.engine.tokenizer.load import load_tokenizer

    return load_tokenizer(resolve_model(model))
