"""The ``kvserve`` command line as a newcomer meets it: no traceback for Ctrl-C, a closed pipe,
or a negative value; the subcommand's usage for a wrong flag; real help texts; token-level
``--logprobs`` output; a second Ctrl-C stops the server at once."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from kvserve.cli import build_parser
from kvserve.engine.config import EngineConfig
from kvserve.service.cli import HELP
from kvserve.testing.plugin import TEST_SERVER_ENV

pytest_plugins = ["kvserve.testing.plugin"]

KVSERVE = [sys.executable, "-m", "kvserve"]


def kvserve(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("flag", ["--max-tokens", "--logprobs", "--seed", "--stop-token-ids"])
def test_negative_values_for_unsigned_flags_are_usage_errors(flag):
    out = kvserve("generate", "hi", flag, "-1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"argument {flag}: must be in [0, " in out.stderr


def test_a_wrong_flag_shows_the_subcommands_usage():
    out = kvserve("generate", "hi", "--temprature", "0")
    assert out.returncode == 2 and out.stderr.startswith("usage: kvserve generate")
    assert "kvserve generate: error: unrecognized arguments: --temprature" in out.stderr


def test_an_unknown_quantization_is_a_usage_error_naming_the_choices():
    out = kvserve("serve", "--quantization", "int3")
    assert out.returncode == 2
    assert "argument --quantization: invalid choice: 'int3' (choose from 'int8', 'int4')" in out.stderr


@pytest.mark.parametrize("command", ["worker", "engine-core", "grammar-compiler", "bench"])
def test_child_processes_start_by_stable_names(command):
    """The engine's children run as `python -m kvserve worker|engine-core` (names that do not move
    with a file); each command's own parser answers, under that name."""
    out = kvserve(command, "-h")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: kvserve {command}")


def test_the_engine_core_command_is_not_listed_for_people():
    listed = kvserve("-h")
    assert listed.returncode == 0 and "worker" in listed.stdout
    assert "engine-core" not in listed.stdout and "grammar-compiler" not in listed.stdout
    assert "SUPPRESS" not in listed.stdout


def test_every_engine_option_has_a_help_text():
    assert [f.name for f in dataclasses.fields(EngineConfig) if f.name not in HELP] == []
    serve_help = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert all(" ".join(HELP[f.name].split()).replace("%%", "%") in serve_help
               for f in dataclasses.fields(EngineConfig))


def test_ctrl_c_in_chat_exits_quietly():
    # Ctrl-C as a terminal delivers it: to a process whose SIGINT is not ignored (in the whole
    # suite something left the test process ignoring it, which children inherit, and Python then
    # keeps ignoring it: the chat saw EOF and exited 0)
    proc = subprocess.Popen([*KVSERVE, "chat", "--target", "127.0.0.1:9"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # waiting at the "> " prompt: seen on stdout (a fixed sleep sent the signal during start-up
    # on a slow machine, where an import swallowed it)
    shown, deadline = b"", time.monotonic() + 60
    while not shown.endswith(b"> ") and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            shown += os.read(proc.stdout.fileno(), 64)
    assert shown.endswith(b"> "), shown
    time.sleep(0.2)  # from the prompt's write to the read that waits
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err


def test_a_closed_pipe_ends_the_cli_quietly(kvserve_server):
    proc = subprocess.Popen([*KVSERVE, "stats", "--target", kvserve_server.target, "--watch", "100"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err


_QUOTED = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""  # a Python repr of a str
_LOGPROB_ROW = re.compile(rf"^\s*(\d+) {_QUOTED} +(-?\d+\.\d{{3}})   (.*)$")
_ALTERNATIVE = re.compile(rf"(\d+) {_QUOTED} (-?\d+\.\d{{3}})")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_shown_per_token_with_text_without_json(kvserve_server, stream):
    """One row per token: id, the token's text, logprob, then each alternative's id, text and
    logprob; the tokens' texts put together are the completion."""
    out = kvserve("generate", "The capital of France is", "--target", kvserve_server.target,
                  "--temperature", "0", "--max-tokens", "3", "--logprobs", "2",
                  *(["--stream"] if stream else []))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [m for m in map(_LOGPROB_ROW.match, lines) if m]
    assert len(rows) == 3, out.stdout
    tokens = []
    for row in rows:
        token = ast.literal_eval(row[2])
        alternatives = _ALTERNATIVE.findall(row[4])
        assert len(alternatives) == 2, row[0]
        # greedy: the best alternative is the chosen token, with its text
        assert alternatives[0][:2] == (row[1], row[2]), row[0]
        assert all(ast.literal_eval(text) for _, text, _ in alternatives), row[0]
        tokens.append(token)
    header = re.search(r"^ +id token +logprob   top alternatives$", out.stdout, re.MULTILINE)
    text = out.stdout[: header.start()].removesuffix("\n")  # the completion, then a newline
    assert tokens[0].strip() and "".join(tokens) == text, out.stdout


def test_a_second_ctrl_c_stops_the_server_at_once(tmp_path):
    from kvserve.clients import Client

    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([*KVSERVE, "serve", "--port", "0", "--dtype", "float32"], stdout=f,
                                stderr=subprocess.STDOUT, env={**TEST_SERVER_ENV, "PATH": "/usr/bin"})
    try:
        end = time.monotonic() + 60
        while not (m := re.search(r"listening on (\S+:\d+)", log.read_text())) and time.monotonic() < end:
            time.sleep(0.05)
        assert m, log.read_text()
        with Client(m.group(1)) as c:
            while c.health() != "SERVING" and time.monotonic() < end:
                time.sleep(0.1)
            # a long request in flight, so that the first Ctrl-C's drain has something to wait for
            stream = c.stream("Once upon a time", max_tokens=4000, ignore_eos=True, temperature=0)
            next(iter(stream))
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=30)
        assert rc == 128 + signal.SIGINT, log.read_text()
        assert time.monotonic() - start < 5.0
        assert "exiting at once" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_unset_sampling_follows_the_bundled_models_recommendation(kvserve_server):
    from kvserve.clients import Client

    with Client(kvserve_server.target) as c:
        chat = [{"role": "user", "content": "Name a color."}]
        plain = c.generate(messages=chat, seed=11, max_tokens=12)
        recommended = c.generate(messages=chat, seed=11, max_tokens=12, temperature=0.2, top_p=0.9)
    assert plain.token_ids == recommended.token_ids


@pytest.mark.parametrize(("env", "flags", "message"), [
    ({"KVSERVE_HEALTH_PORT": "abc"}, [], "$KVSERVE_HEALTH_PORT must be a port number, got 'abc'"),
    ({}, ["--health-port", "70000"], "--health-port (or $KVSERVE_HEALTH_PORT) must be in [0, 65535]"),
])
def test_a_bad_health_port_stops_serve_naming_it(env, flags, message):
    out = kvserve("serve", *flags, env={**os.environ, **env})
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_health_of_an_unreachable_server_is_one_line_and_status_1():
    out = kvserve("health", "--target", "127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 1 and out.stdout == "" and out.stderr.startswith("kvserve: UNAVAILABLE")
    assert "Traceback" not in out.stderr
