"""The front-end <-> engine-core bridge (engine/frontend/async_engine.py) without gRPC, on a tiny
random-weight model in a real core process: the admission bound, aborts on close, per-request
errors (the core's, the tokenizer's, a chat template that raises), the character limit,
shutdown with requests in the hand-over, and a core that is killed or stops answering."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from kvserve.benchmarks.instruments.procfs import alive
from kvserve.engine.config import EngineConfig
from kvserve.engine.frontend.async_engine import AsyncEngine, EngineOverloaded, EngineState, EngineUnavailable
from kvserve.engine.frontend.engine_state import ServerStats
from kvserve.engine.sampling_params import SamplingParams

MAX_NUM_SEQS = 2
# the template raises for one message content, as a template with a bug or a strict check would
RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('template says no') }}"
    "{% endif %}{{ m['content'] }} {% endfor %}"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import write_random_model

    path = write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = RAISING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return str(path)


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=64, **kw)


def long(n: int = 400) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def _started(cfg: EngineConfig, **kw) -> AsyncEngine:
    bridge = AsyncEngine(cfg, **kw)
    bridge.start()
    assert await bridge.wait_ready() == EngineState.READY, bridge.error
    return bridge


async def _idle_stats(bridge: AsyncEngine) -> ServerStats:
    while True:
        s = await bridge.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_queued == 0:
            return s
        await asyncio.sleep(0.01)


def test_admission_counts_requests_not_yet_running_and_closing_aborts_them(tiny_model):
    async def run():
        bridge = await _started(config(tiny_model), max_queue=2)
        before = await _idle_stats(bridge)
        runners = [await bridge.generate(f"r{i}", [1, 2, 3 + i], long()) for i in range(MAX_NUM_SEQS)]
        for r in runners:
            await anext(r)  # running: every seat is taken
        queued = [await bridge.generate(f"q{i}", [4, 5, 6 + i], long()) for i in range(2)]
        with pytest.raises(EngineOverloaded, match="--max-queue 2"):
            await bridge.generate("x", [7, 8], long())
        mid = await bridge.stats()
        for s in runners + queued:
            s.close()
        after = await _idle_stats(bridge)
        await bridge.shutdown()
        return before, mid, after

    before, mid, after = asyncio.run(run())
    assert mid.num_running == MAX_NUM_SEQS
    assert mid.num_waiting + mid.num_queued == 2
    assert mid.requests_rejected == 1 and mid.max_queue == 2
    assert mid.kv_blocks_free < before.kv_blocks_free
    assert after.kv_blocks_free == before.kv_blocks_free
    assert after.requests_aborted - before.requests_aborted == MAX_NUM_SEQS + 2


def test_a_bad_request_fails_alone_and_the_engine_goes_on(tiny_model):
    """Defect: a chat template that raised (jinja's TemplateError is no ValueError) killed the
    engine and hung the requests handed over with it."""

    async def run():
        bridge = await _started(config(tiny_model, max_model_len=64))
        try:
            async def first_error(coro_or_stream):
                stream = await coro_or_stream
                return await anext(stream)

            jobs = [
                bridge.generate("boom", None, long(4), messages=[{"role": "user", "content": "boom"}]),
                bridge.generate("ok-chat", None, long(3), messages=[{"role": "user", "content": "<t5>"}]),
                bridge.generate("too-long", [1, 2, 3], long(100)),  # refused by the core's add_request
                bridge.generate("bad-id", [1, 10**6], long(4)),
                bridge.generate("ok", [1, 2, 3], long(3)),
            ]
            results = await asyncio.gather(*(first_error(j) for j in jobs), return_exceptions=True)
            ok = [out async for out in await bridge.generate("after", [9, 9], long(2))]
            return results, ok, bridge.state
        finally:
            await bridge.shutdown()

    results, ok, state = asyncio.run(run())
    boom, chat, too_long, bad_id, fine = results
    assert isinstance(boom, ValueError) and "chat template" in str(boom) and "template says no" in str(boom)
    assert isinstance(too_long, ValueError) and "max_model_len (64)" in str(too_long)
    assert isinstance(bad_id, ValueError) and "outside the vocabulary" in str(bad_id)
    assert not isinstance(chat, BaseException) and chat.new_token_ids
    assert not isinstance(fine, BaseException) and fine.new_token_ids
    assert ok[-1].finished and ok[-1].completion_tokens == 2
    assert state == EngineState.READY


def test_a_prompt_too_long_for_any_tokenization_is_refused_by_its_length(tiny_model):
    async def run():
        bridge = await _started(config(tiny_model))
        try:
            limit = bridge._prompts.max_prompt_chars
            t0 = time.perf_counter()
            with pytest.raises(ValueError, match=r"prompt: \d+ characters cannot fit max_model_len"):
                await bridge.generate("huge", "<t1> " * 2_000_000, long(4))
            return limit, time.perf_counter() - t0
        finally:
            await bridge.shutdown()

    limit, took = asyncio.run(run())
    assert limit == 2048 * 16  # max_model_len x the floor of 16 characters per token (short vocabulary)
    assert took < 1.0  # refused on its length: 10 MB are never tokenized


def test_shutdown_fails_requests_taken_in_the_same_hand_over(tiny_model):
    """Defect: shutdown() dropped the requests taken from the inbox with the stop, which hung."""

    async def run():
        bridge = await _started(config(tiny_model))
        streams = [await bridge.generate(f"s{i}", [1, 2, i + 3], long()) for i in range(4)]
        await bridge.shutdown()
        outcomes = []
        for s in streams:
            try:
                async for _ in s:
                    pass
                outcomes.append("finished")
            except EngineUnavailable as e:
                outcomes.append(str(e))
        return outcomes, bridge.state

    outcomes, state = asyncio.run(asyncio.wait_for(run(), 60))
    assert outcomes == ["the engine is stopped"] * 4
    assert state == EngineState.STOPPED


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stuck_core_fails_every_request_and_leaves_no_process(tiny_model, how):
    """SIGKILL: the process-exit watch; SIGSTOP: the step timeout (the core sends nothing)."""
    states: list[EngineState] = []

    async def run():
        bridge = await _started(config(tiny_model), on_state=states.append, step_timeout=2.0)
        streams = [await bridge.generate(f"s{i}", [1, 2, i + 3], long(1000)) for i in range(MAX_NUM_SEQS)]
        for s in streams:
            await anext(s)
        pid = bridge.core_pid
        t0 = time.monotonic()
        os.kill(pid, getattr(signal, how))
        errors = []
        for s in streams:
            with pytest.raises(EngineUnavailable) as err:
                async for _ in s:
                    pass
            errors.append(str(err.value))
        took = time.monotonic() - t0
        with pytest.raises(EngineUnavailable, match="engine failed"):
            await bridge.generate("late", [1, 2], long(2))
        await bridge.shutdown()
        return pid, errors, took

    pid, errors, took = asyncio.run(asyncio.wait_for(run(), 120))
    want = "was killed by SIGKILL" if how == "SIGKILL" else "sent nothing for"
    assert all(e.startswith("the engine failed: ") and want in e for e in errors), errors
    assert took < 30
    assert states == [EngineState.READY, EngineState.DEAD]
    assert not alive(pid)
