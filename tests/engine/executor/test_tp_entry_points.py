"""Tensor-parallel engines start from any caller: workers are fresh interpreters of kvserve's own
entry point, so a main module that is standard input (``python -``), a ``-c`` string or a script
with no ``if __name__ == "__main__"`` guard works (multiprocessing's spawn re-imported it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = """
import json, sys
from kvserve.engine import LLM, SamplingParams
llm = LLM(sys.argv[-1], tensor_parallel_size=2, dtype="float32", num_kv_blocks=32, max_model_len=128)
out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps(out[0].token_ids), flush=True)
llm.shutdown()
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import torch

    from kvserve.testing.random_model import write_random_model

    return str(write_random_model("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"), dtype=torch.float32))


@pytest.mark.parametrize("how", ["stdin", "-c", "unguarded script"])
def test_llm_with_tp_workers_starts_from_any_main_module(tiny_model, tmp_path, how):
    if how == "stdin":
        cmd, stdin = [sys.executable, "-", tiny_model], PROGRAM
    elif how == "-c":
        cmd, stdin = [sys.executable, "-c", PROGRAM, tiny_model], None
    else:
        script = tmp_path / "unguarded.py"
        script.write_text(PROGRAM)
        cmd, stdin = [sys.executable, str(script), tiny_model], None
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS")]
    assert len(lines) == 1 and len(json.loads(lines[0].removeprefix("TOKENS "))) == 4
    # the workers attach the leader's shared memory without tracking it: no "leaked" warnings at exit
    assert "leaked shared_memory" not in done.stderr and "resource_tracker" not in done.stderr
