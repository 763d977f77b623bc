"""Grammar compiles in child processes (``python -m kvserve grammar-compiler``), so that one can be
stopped. xgrammar compiles in native code that no thread can interrupt, and some constraints take
hours (a JSON schema's compile time grows with the cube of its nesting). A compile that outlives
its time budget, or whose request went away, ends by killing its process; a fresh process takes
its place at once, so that it has loaded the vocabulary by the next compile.

The child gets the vocabulary once (xgrammar's ``TokenizerInfo``, serialized), answers "ready",
then answers each job (a ``Constraint``) with the compiled grammar serialized, or with the
message of the ValueError that names the constraint's field. Messages are length-prefixed
pickles over the child's stdin and a private copy of its stdout (whatever a library prints goes
to stderr). The child ends when its stdin closes or its lifeline says the engine died.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import re
import select
import struct
import subprocess
import sys
import threading
import time

from kvserve.engine.constraints import Constraint
from kvserve.engine.process.child_process import Child, Lifeline, describe_exit, watch_lifeline

STARTUP_TIMEOUT_S = 300.0  # importing xgrammar and reading the vocabulary, on a loaded machine
POLL_S = 0.05  # how often a waiting compile looks at its request's cancellation
_HEADER = struct.Struct("<Q")
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the client needs what follows
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class CompileCancelled(Exception):
    """The request whose constraint was compiling went away; its compile was stopped."""


class CompilerFailed(RuntimeError):
    """The compile process died (killed, or crashed) under a compile: the server's fault, worth a
    retry (a fresh process has taken its place), not the constraint's."""


class CompileWorker:
    """The engine's side of one compile process: one compile at a time (callers take turns)."""

    def __init__(self, vocabulary: bytes):
        self._vocabulary = vocabulary
        self._child: Child | None = None
        self._lifeline: Lifeline | None = None
        self._ready = False

    def start(self) -> None:
        """Start the process (it loads the vocabulary meanwhile); a no-op when it runs."""
        if self._child is not None:
            return
        self._lifeline = Lifeline()
        fd = self._lifeline.read_fd
        self._child = Child("grammar-compiler", ["--parent-fd", str(fd)], pass_fds=(fd,),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._lifeline.close_read_end()
        self._ready = False
        # the child reads it once it runs: a thread writes it, so that nobody waits for that
        threading.Thread(target=_send_quietly, args=(self._child.popen.stdin, self._vocabulary),
                         name="kvserve-grammar-vocabulary", daemon=True).start()

    def is_ready(self) -> bool:
        """Whether the process has loaded the vocabulary and still runs (looks without waiting); a
        process that died while idle is replaced here, before anyone writes to it."""
        if self._child is not None and self._child.popen.poll() is not None:
            self.restart()
        if self._ready or self._child is None:
            return self._ready
        if select.select([self._child.popen.stdout], [], [], 0)[0]:
            self._ready = _recv(self._child.popen.stdout) == b"ready"
            if not self._ready:  # it died while starting: the next compile starts another
                self.stop()
        return self._ready

    def compile(self, c: Constraint, timeout_s: float, cancelled: threading.Event) -> str:
        """The serialized compiled grammar of ``c``. Raises ValueError when it does not compile or
        not within ``timeout_s`` (naming the budget), CompileCancelled when ``cancelled`` is set,
        CompilerFailed when the process died under it."""
        if self._child is not None and self._child.popen.poll() is not None:
            self.restart()  # it died while idle
        self.start()
        if not self._ready:  # the vocabulary's load is not the request's time
            self._await(STARTUP_TIMEOUT_S, cancelled, c, startup=True)
            self._ready = True
        try:
            _send(self._child.popen.stdin, pickle.dumps(c))
        except (BrokenPipeError, ValueError):  # it died after the look above
            code = self._child.popen.wait()
            self.restart()
            raise CompilerFailed(f"{c.kind}: the grammar compiler {describe_exit(code)} before the compile "
                                 "began; retry") from None
        status, payload = pickle.loads(self._await(timeout_s, cancelled, c))
        if status == "error":
            raise ValueError(payload)
        return payload

    def _await(self, timeout_s: float, cancelled: threading.Event, c: Constraint,
               startup: bool = False) -> bytes:
        out = self._child.popen.stdout
        deadline = time.monotonic() + timeout_s
        while True:
            if cancelled.is_set():
                self.restart()
                raise CompileCancelled(c.kind)
            left = deadline - time.monotonic()
            if left <= 0:
                self.restart()
                if startup:
                    raise ValueError(f"{c.kind}: the grammar compiler did not start within {timeout_s:g} s")
                raise ValueError(f"{c.kind}: did not compile within the time budget of {timeout_s:g} s "
                                 "(--grammar-compile-timeout); simplify the constraint")
            if select.select([out], [], [], min(POLL_S, left))[0]:
                message = _recv(out)
                if message is None:  # the process ended: killed, or a crash in the compiler
                    code = self._child.popen.wait()
                    self.restart()
                    raise CompilerFailed(f"{c.kind}: the grammar compiler {describe_exit(code)} while "
                                         "compiling; a fresh one has taken its place, retry")
                return message

    def restart(self) -> None:
        """Kill the process and start a fresh one."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self._child is None:
            return
        self._child.kill()
        self._child.join()
        for pipe in (self._child.popen.stdin, self._child.popen.stdout):
            pipe.close()
        self._child.close()
        self._lifeline.close()
        self._child = self._lifeline = None


def _send(f, payload: bytes) -> None:
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[f.write(view):]


def _send_quietly(f, payload: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):  # stopped meanwhile (ValueError: closed pipe)
        _send(f, payload)


def _recv(f) -> bytes | None:
    """One message, or None at EOF."""
    header = _read_exactly(f, _HEADER.size)
    return None if header is None else _read_exactly(f, _HEADER.unpack(header)[0])


def _read_exactly(f, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---- the child process ---------------------------------------------------------------------------
def compile_constraint(compiler, c: Constraint):
    """xgrammar's compiled grammar of ``c``; ValueError naming the field when it does not compile."""
    try:
        if c.kind == "json_schema":
            # compact JSON: a small model offered free whitespace may spend its tokens on it
            return compiler.compile_json_schema(c.text, any_whitespace=False)
        if c.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "regex":
            return compiler.compile_regex(c.text)
        if c.kind == "grammar":
            return compiler.compile_grammar(c.text)
        return compiler.compile_grammar(choice_grammar(c.choices))
    except RuntimeError as e:  # xgrammar reports every parse / conversion error this way
        message = _LOG_PREFIX.sub("", str(e).strip()).strip()
        raise ValueError(f"{c.kind}: does not compile: {message}") from None


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(s) for s in choices)


def _ebnf_literal(s: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    out = [escapes.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x20 else ch) for ch in s]
    return '"' + "".join(out) + '"'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve grammar-compiler",
                                     description="compiles structured-output constraints for the engine")
    parser.add_argument("--parent-fd", type=int, help="pipe whose EOF means the engine died")
    args = parser.parse_args(argv)
    if args.parent_fd is not None:
        watch_lifeline(args.parent_fd, lambda: os._exit(1))
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints must not corrupt the replies
    inp = sys.stdin.buffer
    vocabulary = _recv(inp)
    if vocabulary is None:
        return 0
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(vocabulary.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _send(out, b"ready")
    while (job := _recv(inp)) is not None:
        try:
            reply = ("ok", compile_constraint(compiler, pickle.loads(job)).serialize_json())
        except ValueError as e:
            reply = ("error", str(e))
        _send(out, pickle.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
