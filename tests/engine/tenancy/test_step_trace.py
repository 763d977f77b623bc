"""The step trace (``--step-trace``, engine/tenancy/step_trace.py) of a real engine (a tiny random Qwen2 on
the CPU): a tenant holding every slot, then another tenant's short request. Each step's line says what the
scheduler chose (its kind, rows and prefill tokens per tenant) and how long it took against the model;
the request's first-token line names the steps it waited on."""

import gc
import json

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.llm_engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sequence import Tenancy

SEQS = 4


@pytest.fixture(scope="module")
def traced(tiny_qwen2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32", max_num_seqs=SEQS,
                                    max_model_len=256, num_kv_blocks=256, step_trace=str(path),
                                    tenant_linger_ms=60_000))
    flood = SamplingParams(n=SEQS, max_tokens=40, ignore_eos=True, temperature=1.0)
    engine.add_tokenized("flood-0", list(range(10, 90)), flood, Tenancy("flood"))
    steps = 0
    while engine.num_running() < SEQS or engine.num_waiting():
        engine.step()
        steps += 1
    for _ in range(3):
        engine.step()
    engine.add_tokenized("interactive-0", [5, 6, 7, 8] * 3, SamplingParams(max_tokens=3, ignore_eos=True),
                         Tenancy("interactive"))
    while "interactive-0" in engine.requests:
        engine.step()
    for _ in range(3):  # it lingers: the flood's steps stay due
        engine.step()
    callbacks = len(gc.callbacks)
    engine.shutdown()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {"steps": [r for r in lines if "first" not in r], "firsts": [r for r in lines if "first" in r],
            "callbacks": (callbacks, len(gc.callbacks))}


def test_every_step_has_a_line_in_order_with_its_time_and_the_models(traced):
    steps = traced["steps"]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for before, s in zip(steps, steps[1:], strict=False):
        assert before["end"] <= s["start"] + 1e-6 and s["gap"] >= -1e-6
        assert s["actual"] > 0 and abs((s["end"] - s["start"]) - s["actual"]) < 1e-6
    assert steps[0]["predicted"] is None and all(s["predicted"] is not None for s in steps[1:])
    assert all(len(s["coef"]) == 3 for s in steps[1:])


def test_rows_held_and_prefill_per_tenant_account_for_every_running_sequence(traced):
    for s in traced["steps"]:
        flood = s["tenants"].get("flood", {"rows": 0, "held": 0, "prefill": 0, "waiting": 0})
        decoding = flood["rows"] + flood["held"]
        assert flood["rows"] + flood["held"] + flood["waiting"] <= SEQS, s
        assert decoding <= SEQS, s
    total = sum(s["tenants"].get("interactive", {}).get("prefill", 0) for s in traced["steps"])
    assert total == 12  # its prompt, computed once


def test_the_kinds_follow_the_tenants_present(traced):
    steps, firsts = traced["steps"], traced["firsts"]
    (request,) = [f for f in firsts if f["first"].startswith("interactive-0")]
    # one tenant so far: its steps are its own; while the request waits to be admitted a light tenant's
    # first token is due, and after it ended its tenant lingers (60 s here): every step since is held
    assert all(s["kind"] == "unshared" for s in steps[:request["after"] + 1])
    assert request["after"] < request["admitted"] <= request["step"] < len(steps)
    for s in steps[request["after"] + 1:request["admitted"] + 1]:
        assert s["kind"] in ("held", "progress"), s
    assert steps[request["admitted"]]["tenants"]["interactive"]["prefill"] > 0
    last = max(s["step"] for s in steps if "interactive" in s["tenants"])  # its last token's
    after = steps[last + 1:]
    assert after and all(s["kind"] in ("held", "progress") and "interactive" in s["linger"] for s in after)


def test_first_tokens_name_each_sequence_once_and_the_trace_lets_go_of_the_collector(traced):
    firsts = traced["firsts"]
    assert sorted(f["first"].split("#")[0] for f in firsts) == ["flood-0"] * SEQS + ["interactive-0"]
    assert len({f["seq"] for f in firsts}) == len(firsts)
    for f in firsts:
        assert f["admitted"] <= f["step"]
    before, after = traced["callbacks"]
    assert after == before - 1
