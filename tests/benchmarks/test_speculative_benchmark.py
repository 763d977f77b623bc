"""The speculative-decoding benchmark runs end to end (tiny random model): both arms per set and
batch size, the same tokens in both, and its JSON."""

import json
from types import SimpleNamespace

import pytest

from kvserve.benchmarks import speculative
from kvserve.engine.spec_decode.policy import StepCosts
from kvserve.testing.random_model import write_random_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(write_random_model("llama-tiny", tmp_path_factory.mktemp("llama-tiny")))


def test_speculative_benchmark_runs_both_arms_on_every_set(tiny_llama, capsys, tmp_path):
    out = tmp_path / "spec.json"
    speculative.main(["--model", tiny_llama, "--dtype", "float32", "--batches", "1", "2", "--requests", "2",
                      "--max-tokens", "8", "--rounds", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["set"], r["batch"]) for r in rows] == [
        (s, b) for s in ("grounded", "structured", "chat") for b in (1, 2)]
    assert all(r["same_tokens"] and r["tok_s_off"] > 0 and r["tok_s_on"] > 0 for r in rows)
    # after the first token, per stream (a set whose requests gave one token each has no such time)
    assert all(r["decode_tok_s_off"] > 0 and r["decode_speedup"] > 0
               for r in rows if r["output_tokens"] > r["requests"])
    assert any(r["output_tokens"] > r["requests"] for r in rows)
    bounded = {(r["set"], r["batch"]) for r in rows if "oracle_speedup" in r}
    assert bounded <= {("grounded", 1), ("chat", 1)}  # one stream, n-gram drafts alone
    printed = capsys.readouterr().out
    assert "step costs c(n)" in printed and "grounded    batch   1" in printed


def test_the_drafters_bound_verifies_exactly_the_drafts_kept():
    """Prompt 1..10, output 5..10: no 2-token match after the first output token (one plain
    step), then [5, 6] matches and the last four tokens come in one verification of three kept
    drafts (the fourth is the bonus): five tokens after the first in two steps."""
    spec = SimpleNamespace(min_n=2, max_n=3, max_drafts=5, costs=StepCosts({1: 1.0, 8: 1.0}))
    llm = SimpleNamespace(engine=SimpleNamespace(speculator=spec))
    prompt, out = list(range(1, 11)), [5, 6, 7, 8, 9, 10]
    assert speculative.oracle_decode_speedup(llm, [prompt], [out]) == pytest.approx(5 / 2)
    spec.costs = StepCosts({1: 1.0, 4: 2.0})  # the verification's 4 rows cost 2 steps
    assert speculative.oracle_decode_speedup(llm, [prompt], [out]) == pytest.approx(5 / 3)


def test_llama_cpp_peer_needs_the_bundled_model_a_single_stream_and_its_setup(
        tiny_llama, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        speculative.main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    for argv in (["--model", tiny_llama], ["--batches", "8"]):
        with pytest.raises(SystemExit):
            speculative.main([*argv, "--peer", "llama.cpp"])
        assert "--peer llama.cpp: the bundled model" in capsys.readouterr().err
    monkeypatch.setenv("KVSERVE_PEERS_DIR", str(tmp_path / "no-peers"))
    with pytest.raises(SystemExit, match="make bench-peers"):
        speculative.llama_single_stream({"grounded": ([[1, 2, 3]], [4])})
