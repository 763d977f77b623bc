"""A step that raises loses nothing: the abort outputs taken for that step come out of the
next one (defect: they were dropped, and whoever waited for them waited forever)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.llm_engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import FinishReason


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvserve.testing.random_model import write_random_model

    path = write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, max_model_len=128))
    yield eng
    eng.shutdown()


def test_abort_outputs_survive_a_step_that_raises(engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    engine.step()
    assert engine.abort("a")

    def broken(inp):
        raise RuntimeError("injected device error")

    monkeypatch.setattr(engine.executor, "execute_model", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["a"].finished and outputs["a"].finish_reason == FinishReason.ABORT
    assert not outputs["b"].finished and outputs["b"].new_token_ids
    engine.abort("b")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
