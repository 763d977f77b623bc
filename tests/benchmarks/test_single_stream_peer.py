"""llama.cpp as the single-stream peer: the Node script's protocol on the default GGUF, and the
wiring in benchmarks/single_stream.py (same workload, kvserve's thread count, ratio) with the
engines stubbed. Nothing here times anything."""

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from kvserve.benchmarks import single_stream
from kvserve.benchmarks.offline import make_requests
from kvserve.engine.model_loader.source import resolve_model

needs_node_llama_cpp = pytest.mark.skipif(
    shutil.which("node") is None or not (single_stream.PEER_DIR / "node_modules" / "node-llama-cpp").is_dir(),
    reason=f"node or node-llama-cpp missing (benchmarks/llamacpp/node_modules); {single_stream.PEER_INSTALL}",
)


def run_script(gguf_path: str, requests: dict, threads: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(single_stream.peer_command(gguf_path, threads), input=json.dumps(requests),
                          capture_output=True, text=True, timeout=120, check=False)


@needs_node_llama_cpp
def test_llamacpp_script_prints_one_json_line_with_exactly_max_tokens_past_end_of_generation(default_source):
    from kvserve.engine.model_loader.loader import load_hf_config

    eos = load_hf_config(default_source).eos_token_id
    # a chat turn that is already answered: greedy decoding ends it at once with <|im_end|>
    answered = "<|im_start|>user\nSay only the word yes.<|im_end|>\n<|im_start|>assistant\nYes."
    requests = {"requests": [{"prompt": [5, 17, 300, 4000], "max_tokens": 3},
                             {"prompt": answered, "max_tokens": 6}]}
    # one thread: this checks the protocol, not speed (a two-thread llama.cpp crawls on a busy machine)
    proc = run_script(default_source.gguf_path, requests)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["engine"] == "llama.cpp" and result["node_llama_cpp"] == "3.21.1"
    assert result["threads"] == 1
    assert result["requests"] == 2 and result["output_tokens"] == 9
    assert [len(t) for t in result["token_ids"]] == [3, 6]
    assert result["token_ids"][1][0] == eos  # yielded, and generation went on past it
    assert result["seconds"] > 0 and result["output_tok_s"] > 0 and result["decode_tok_s"] > 0


@needs_node_llama_cpp
def test_llamacpp_script_rejects_a_bad_request_naming_the_field(default_source):
    proc = run_script(default_source.gguf_path, {"requests": [{"prompt": [1, 2], "max_tokens": 0}]})
    assert proc.returncode == 2
    assert "requests[0].max_tokens" in proc.stderr
    assert proc.stdout == ""


def test_peer_requests_are_the_kvserve_workload():
    args = SimpleNamespace(num_requests=3, new_tokens=5, seed=7)
    prompts, outputs = single_stream.workload(args, vocab_size=49152)
    assert outputs == [5, 5, 5] and len(prompts) == 3
    assert prompts == make_requests(3, (32, 128), (5, 5), 7, vocab=10000)[0]  # the same prompt ids
    requests = single_stream.peer_requests(prompts, outputs)
    assert requests == {"requests": [{"prompt": p, "max_tokens": 5} for p in prompts]}


def test_ratio_and_agreement_against_the_peer():
    results = [{"output_tok_s": 60.0, "token_ids": [[1, 2, 3], [4, 5]]},
               {"output_tok_s": 180.0, "token_ids": [[1, 9, 3], [4, 5]]}]
    single_stream.compare_with_peer(results, {"output_tok_s": 150.0, "token_ids": [[1, 2, 3], [4, 5]]})
    assert results[0]["llamacpp_ratio"] == pytest.approx(0.4) and results[0]["llamacpp_agreement"] == 1.0
    assert results[1]["llamacpp_ratio"] == pytest.approx(1.2) and results[1]["llamacpp_agreement"] == 0.6


def test_peer_unavailable_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(single_stream, "PEER_DIR", tmp_path)
    monkeypatch.setattr(single_stream.shutil, "which", lambda name: f"/usr/bin/{name}")  # node or not
    assert "npm ci --prefix benchmarks/llamacpp" in single_stream.peer_unavailable(resolve_model("default"))


def test_peer_unavailable_for_a_model_that_is_not_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # enough for resolve_model to take it as a HF directory
    assert "not a GGUF file" in single_stream.peer_unavailable(resolve_model(str(tmp_path)))


def fake_measure(variant, args):
    prompts, outputs = single_stream.workload(args, vocab_size=49152)
    tok_s = {"none": 50.0, "int8": 200.0, "int4": 125.0}[variant]
    return {"variant": variant, "dtype": "bfloat16", "output_tok_s": tok_s, "parity": [[1, 2]], "threads": 3,
            "vocab_size": 49152, "token_ids": [[7] * m for m in outputs]}


def test_main_runs_the_peer_on_the_same_workload_with_kvserves_threads(monkeypatch, capsys, tmp_path):
    calls = []

    def fake_run_peer(gguf_path, threads, requests, timeout_s=None):
        calls.append((gguf_path, threads, requests))
        return {"node_llama_cpp": "3.21.1", "threads": threads, "output_tok_s": 100.0, "decode_tok_s": 110.0,
                "token_ids": [[7] * r["max_tokens"] for r in requests["requests"]]}

    monkeypatch.setattr(single_stream, "measure", fake_measure)
    monkeypatch.setattr(single_stream, "peer_unavailable", lambda source: None)
    monkeypatch.setattr(single_stream, "run_peer", fake_run_peer)
    out = tmp_path / "figures.json"
    figures = single_stream.main(["--num-requests", "2", "--new-tokens", "4", "--json", str(out)])

    (gguf_path, threads, requests), = calls
    assert gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and threads == 3
    args = SimpleNamespace(num_requests=2, new_tokens=4, seed=0)
    assert requests == single_stream.peer_requests(*single_stream.workload(args, 49152))
    assert [r["llamacpp_ratio"] for r in figures["kvserve"]] == [0.5, 2.0, 1.25]  # none, int8, int4
    printed = capsys.readouterr().out
    assert "0.50x llama.cpp" in printed and "2.00x llama.cpp" in printed and "1.25x llama.cpp" in printed
    assert "100.0 output tok/s" in printed
    assert json.loads(out.read_text())["llama.cpp"]["output_tok_s"] == 100.0


def test_main_skips_a_missing_peer_by_default_and_refuses_it_when_asked(monkeypatch, capsys):
    monkeypatch.setattr(single_stream, "measure", fake_measure)
    monkeypatch.setattr(single_stream, "peer_unavailable", lambda source: "not installed; npm ci ...")
    figures = single_stream.main(["--num-requests", "1", "--new-tokens", "2"])
    assert figures["llama.cpp"] is None and figures["peer_skipped"] == "not installed; npm ci ..."
    assert "llama.cpp peer skipped: not installed; npm ci ..." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        single_stream.main(["--peer", "llama.cpp"])
    assert "--peer llama.cpp: not installed" in capsys.readouterr().err
