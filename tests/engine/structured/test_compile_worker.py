"""Grammar compiles that cannot block structured output: a json_schema nested deeper than
MAX_SCHEMA_DEPTH is refused before compiling; a compile over its time budget is stopped and
refused naming the budget; compiles whose requests went away are killed, so that a json_object
request right after two abandoned hours-long compiles is not held up behind them; the compile
processes end with the engine's structured output."""

from __future__ import annotations

import os
import time

import pytest

from kvserve.benchmarks.instruments.procfs import alive, children, named
from kvserve.engine.constraints import MAX_SCHEMA_DEPTH, Constraint, json_depth
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.structured.grammar import StructuredOutput


def nested(depth: int) -> str:
    """Issue 29's schema: ``{"items": ...}`` nested ``depth`` deep (compile time grows as its cube)."""
    return '{"items":' * depth + "{}" + "}" * depth


def test_deep_json_schema_is_refused_before_compiling():
    schema = nested(6500)  # 65,002 characters (under the limit); about three hours to compile
    assert len(schema) == 65002
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"json_schema: nests objects and arrays 6501 levels deep; at most "
                                         f"{MAX_SCHEMA_DEPTH}"):
        SamplingParams(json_schema=schema).validate(49152)
    assert time.monotonic() - started < 10  # refused by a scan, never compiled (hours)
    SamplingParams(json_schema=nested(MAX_SCHEMA_DEPTH - 1)).validate(49152)
    assert json_depth('{"a": "[[{{\\"", "b": [1, [2]]}') == 3  # brackets in strings do not count


def wait_compiled(so: StructuredOutput, bound_s: float = 120.0) -> list:
    deadline = time.monotonic() + bound_s  # a bound for liveness only, far above a normal compile
    while time.monotonic() < deadline:
        done = so.take_compiled(0.2)
        if done:
            return done
    raise AssertionError(f"nothing compiled within {bound_s} s")


def compile_processes() -> list[int]:
    return named(children(os.getpid()), b"grammar-compiler")


@pytest.fixture(scope="module")
def tokenizer(default_source):
    from kvserve.engine.tokenizer.load import load_tokenizer

    return load_tokenizer(default_source)


def test_abandoned_slow_compiles_are_killed_and_budget_refuses_by_name(tokenizer):
    so = StructuredOutput(tokenizer, 49152, [2], workers=2, timeout_s=2.0)
    try:
        so.compile(Constraint("regex", "[0-9]+"))  # processes up and ready
        pids = compile_processes()
        assert len(pids) == 3  # two at work at most, one spare
        # two compiles of about an hour each, then their requests go away
        so.submit("slow-1", Constraint("json_schema", nested(1500)))
        so.submit("slow-2", Constraint("json_schema", nested(1501)))
        time.sleep(0.5)
        so.cancel("slow-1")
        so.cancel("slow-2")
        so.submit("object", Constraint("json_object", ""))
        [(item, grammar)] = wait_compiled(so)
        assert item == "object" and not isinstance(grammar, BaseException)
        # over the budget: stopped and refused naming the budget and the flag
        so.submit("over", Constraint("json_schema", nested(400)))
        [(item, error)] = wait_compiled(so)
        assert item == "over" and isinstance(error, ValueError)
        budget = "json_schema: did not compile within the time budget of 2 s (--grammar-compile-timeout)"
        assert budget in str(error)
        assert so.num_compiling == 0
    finally:
        so.shutdown()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
