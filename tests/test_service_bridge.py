"""The asyncio <-> engine-thread bridge (engine/async_engine.py) over a real engine, without
gRPC: the admission bound, aborts on close, validation errors, and an engine failure."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.async_engine import AsyncEngine, EngineOverloaded, EngineState, EngineUnavailable
from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams

MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(max_num_seqs=MAX_NUM_SEQS, kv_cache_memory=0.1))
    yield eng
    eng.shutdown()


def long(n: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _started(source, **kw) -> AsyncEngine:
    bridge = AsyncEngine(source, **kw)
    bridge.start()
    assert await bridge.wait_ready() == EngineState.READY
    return bridge


async def _idle_stats(bridge: AsyncEngine) -> dict:
    while True:
        s = await bridge.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_queued"] == 0:
            return s
        await asyncio.sleep(0.01)


def test_admission_counts_requests_not_yet_running_and_closing_aborts_them(engine):
    async def run():
        bridge = await _started(engine, max_queue=2)
        before = await _idle_stats(bridge)
        runners = [await bridge.generate(f"r{i}", f"Runner {i}", long()) for i in range(MAX_NUM_SEQS)]
        for r in runners:
            await anext(r)  # running: every seat is taken
        queued = [await bridge.generate(f"q{i}", f"Queued {i}", long()) for i in range(2)]
        with pytest.raises(EngineOverloaded, match="--max-queue 2"):
            await bridge.generate("x", "One too many", long())
        mid = await bridge.stats()
        for s in runners + queued:
            s.close()
        after = await _idle_stats(bridge)
        await bridge.shutdown()
        return before, mid, after

    before, mid, after = asyncio.run(run())
    assert mid["num_running"] == MAX_NUM_SEQS
    assert mid["num_waiting"] + mid["num_queued"] == 2
    assert mid["requests_rejected"] == 1 and mid["max_queue"] == 2
    assert mid["kv_blocks_free"] < before["kv_blocks_free"]
    assert after["kv_blocks_free"] == before["kv_blocks_free"]
    # the queued ones are aborted too, unless they were still in the hand-over queue
    assert after["requests_aborted"] - before["requests_aborted"] >= MAX_NUM_SEQS


def test_errors_found_by_the_engine_come_out_of_the_stream(engine):
    async def run():
        bridge = await _started(engine)
        try:
            stream = await bridge.generate("bad", [1, engine.vocab_size], long(4))
            with pytest.raises(ValueError, match="token_ids"):
                await anext(stream)
            chat = [{"role": "wizard", "content": "hi"}]
            stream = await bridge.generate("role", None, long(4), messages=chat)
            with pytest.raises(ValueError, match="role"):
                await anext(stream)
            ok = [out async for out in await bridge.generate("ok", "Hello", long(3))]
            assert ok[-1].finished and ok[-1].completion_tokens == 3
        finally:
            await bridge.shutdown()

    asyncio.run(run())


class _StepFails:
    """The real engine, except that ``step`` raises once ``after`` steps have run (fault injection)."""

    def __init__(self, engine: LLMEngine, after: int):
        self._engine, self._left = engine, after

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        if self._left == 0:
            raise RuntimeError("injected step failure")
        self._left -= 1
        return self._engine.step()


def test_an_engine_failure_fails_requests_with_unavailable_and_marks_it_dead(engine):
    states: list[EngineState] = []

    async def run():
        bridge = await _started(_StepFails(engine, after=3), on_state=states.append)
        got = []
        with pytest.raises(EngineUnavailable, match="injected step failure"):
            async for out in await bridge.generate("a", "Hello", long(50)):
                got.append(out)
        assert got and not any(out.finished for out in got)
        assert bridge.state == EngineState.DEAD
        with pytest.raises(EngineUnavailable, match="engine failed"):
            await bridge.generate("b", "Hello", long(5))
        with pytest.raises(EngineUnavailable):
            await bridge.stats()
        await bridge.shutdown()

    asyncio.run(run())
    assert states == [EngineState.READY, EngineState.DEAD]
    assert engine.num_running() == 0 and engine.num_waiting() == 0  # the bridge aborted what it left
