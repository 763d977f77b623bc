"""The client subcommands of ``kvserve``: ``generate``, ``chat``, ``stats``.

Sampling flags are derived from ``SamplingParams`` in llm.proto, so they never drift from
the API: ``--temperature``, ``--max-tokens``, ``--stop`` (repeatable), ``--ignore-eos``, ...
Unset flags leave the server's defaults. The text of ``--json-schema``, ``--regex`` and
``--grammar`` may be read from a file: ``--json-schema @schema.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.descriptor import FieldDescriptor

from kvserve.clients.messages import DEFAULT_TARGET, SAMPLING_FIELDS

_FLOATS = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)
_INTS = (
    FieldDescriptor.CPPTYPE_INT32,
    FieldDescriptor.CPPTYPE_INT64,
    FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64,
)


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt (whole or --stream)")
    _add_target(p)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (one turn, or interactive without a message)")
    _add_target(p)
    p.add_argument("message", nargs="?", help="the user message; omit for an interactive chat")
    p.add_argument("--system", help="a system message")
    add_sampling_flags(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("stats", help="print the server's Stats as JSON")
    _add_target(p)
    p.add_argument("--watch", type=int, metavar="MS", help="print a snapshot every MS milliseconds")
    p.set_defaults(func=cmd_stats)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("KVSERVE_TARGET", DEFAULT_TARGET),
                   help="server address host:port (env KVSERVE_TARGET; default %(default)s)")
    p.add_argument("--timeout", type=float, help="deadline in seconds")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field of llm.proto (unset = the server's default)."""
    g = p.add_argument_group("sampling (SamplingParams in proto/kvserve/v1/llm.proto)")
    for name, f in SAMPLING_FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if f.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        elif f.is_repeated:
            kind = int if f.cpp_type in _INTS else str
            g.add_argument(flag, dest=name, type=kind, action="append", help="repeat for more")
        elif f.cpp_type == FieldDescriptor.CPPTYPE_STRING:
            g.add_argument(flag, dest=name, type=_text_or_file, help="text, or @FILE to read it from a file")
        else:
            g.add_argument(flag, dest=name, type=float if f.cpp_type in _FLOATS else int)


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {e.strerror}") from None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name, None) is not None}


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.clients.client import Client

    with Client(args.target, timeout=args.timeout) as client:
        return _rpc(lambda: _generate(client, args))


def _generate(client, args: argparse.Namespace) -> int:
    sampling = sampling_kwargs(args)
    if not args.stream:
        done = client.generate(args.prompt, **sampling)
        if args.json:
            print(json.dumps(_as_dict(done), indent=2))
        for choice in ([] if args.json else done.choices):
            if len(done.choices) > 1:
                print(f"--- choice {choice.index} ({choice.finish_reason}) ---")
            print(choice.text)
        return 0
    for delta in client.stream(args.prompt, **sampling):
        if args.json or (sampling.get("n") or 1) > 1:  # n > 1: pieces of the choices interleave
            print(json.dumps(_as_dict(delta)), flush=True)
        else:
            print(delta.text, end="", flush=True)
            if delta.finished:
                print(flush=True)
                print(f"[{delta.finish_reason}, {delta.usage.completion_tokens} tokens, "
                      f"ttft {delta.timing.ttft_ms:.0f} ms, total {delta.timing.total_ms:.0f} ms]",
                      file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.clients.client import Client

    history = [{"role": "system", "content": args.system}] if args.system else []
    with Client(args.target, timeout=args.timeout) as client:
        if args.message is not None:
            return _rpc(lambda: _chat_turn(client, history, args.message, args))
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            if line.strip():
                status = _rpc(lambda line=line: _chat_turn(client, history, line, args))
                if status:
                    return status


def _chat_turn(client, history: list[dict], message: str, args: argparse.Namespace) -> int:
    history.append({"role": "user", "content": message})
    reply = []
    for delta in client.stream(messages=history, **sampling_kwargs(args)):
        reply.append(delta.text)
        print(delta.text, end="", flush=True)
    print()
    history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvserve.clients.client import Client

    with Client(args.target, timeout=args.timeout) as client:
        if args.watch is None:
            return _rpc(lambda: print(json.dumps(client.stats(), indent=2)) or 0)
        try:
            return _rpc(lambda: _watch(client, args.watch))
        except KeyboardInterrupt:
            return 0


def _watch(client, interval_ms: int) -> int:
    for snapshot in client.watch_stats(interval_ms):
        print(json.dumps(snapshot), flush=True)
    return 0


def _rpc(fn) -> int:
    """Run a client call; a gRPC error becomes a one-line message and exit status 1."""
    try:
        return fn()
    except grpc.RpcError as e:
        print(f"kvserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def _as_dict(obj) -> dict:
    from dataclasses import asdict

    return asdict(obj)
