"""The Node.js example (clients/node, @grpc/grpc-js + @grpc/proto-loader from npm) streams a
completion from the shared server that equals the Python client's, and prints its logprobs
with their token texts as `kvserve generate --logprobs` does."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kvserve.clients import Client

pytest_plugins = ["kvserve.testing.plugin"]

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture(scope="module")
def node():
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        out = subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                             text=True, timeout=600)
        if out.returncode != 0:
            pytest.skip(f"npm install failed (no registry access?): {out.stderr[-500:]}")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([node, "client.js", *args], cwd=NODE_DIR, capture_output=True, text=True,
                              timeout=120)

    return run


def test_node_client_streams_the_same_completion_as_python(node, kvserve_server):
    prompt = "Once upon a time"
    out = node("--target", kvserve_server.target, "--prompt", prompt, "--max-tokens", "10", "--json")
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(line) for line in out.stdout.splitlines()]
    with Client(kvserve_server.target) as c:
        want = c.generate(prompt, temperature=0, max_tokens=10)
    assert [t for m in msgs for t in m["token_ids"]] == want.token_ids
    assert "".join(m["text"] for m in msgs) == want.text
    assert msgs[-1]["finish_reason"] == want.finish_reason
    assert msgs[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    assert all(m["finish_reason"] == "FINISH_REASON_UNSPECIFIED" for m in msgs[:-1])


def _table_row(line: str) -> tuple[int, str, float, list[tuple[int, str, float]]]:
    """One row of the logprob table: id, token text (a JSON string), logprob, then the top
    alternatives, each ``id "text" logprob``, joined by ", "."""
    decode = json.JSONDecoder().raw_decode
    token, end = decode(line, 8)  # the id is right-aligned in 7 columns, then a space
    logprob, rest = line[end:].split(None, 1)
    top = []
    while rest:
        token_id, rest = rest.split(" ", 1)
        text, end = decode(rest)
        value, _, rest = rest[end:].strip().partition(", ")
        top.append((int(token_id), text, float(value)))
    return int(line[:7]), token, float(logprob), top


def test_node_client_prints_logprob_token_texts_like_the_python_cli(node, kvserve_server):
    prompt = "The capital of France is"
    out = node("--target", kvserve_server.target, "--prompt", prompt, "--max-tokens", "4", "--logprobs", "2")
    assert out.returncode == 0, out.stderr
    with Client(kvserve_server.target) as c:
        want = c.generate(prompt, temperature=0, max_tokens=4, logprobs=2)
    assert out.stdout.startswith(want.text + "\n")
    header, *rows = out.stdout[len(want.text) + 1:].rstrip("\n").split("\n")
    assert header == f"{'id':>7} {'token':<16} {'logprob':>8}   top alternatives"
    for line, lp in zip(rows, want.logprobs, strict=True):
        token_id, token, logprob, top = _table_row(line)
        alternatives = [(t, text, v) for (t, v), text in zip(lp.top, lp.top_tokens, strict=True)]
        assert (token_id, token) == (lp.token_id, lp.token) and logprob == pytest.approx(lp.logprob, abs=2e-3)
        assert [a[:2] for a in top] == [a[:2] for a in alternatives]
        assert [a[2] for a in top] == pytest.approx([a[2] for a in alternatives], abs=2e-3)


def test_node_client_reads_stats_and_reports_errors(node, kvserve_server):
    out = node("--target", kvserve_server.target, "--stats")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_block_size"] == 16
    out = node("--target", kvserve_server.target, "--temperature", "-1")
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "temperature" in out.stderr


def test_node_client_speaks_mutual_tls_with_the_api_key(node, secure_server, tls_files):
    from kvserve.testing.plugin import SECURE_API_KEY

    tls = ("--target", secure_server.target, "--tls-ca", tls_files["ca"],
           "--tls-cert", tls_files["client_cert"], "--tls-key", tls_files["client_key"])
    out = node(*tls, "--api-key", SECURE_API_KEY, "--stats")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_block_size"] == 16
    out = node(*tls, "--prompt", "Hi", "--max-tokens", "2", "--json")
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
