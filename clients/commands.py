"""The client subcommands of ``kvserve``: ``generate``, ``chat``, ``stats``, ``health``.

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

from kvserve.clients.messages import DEFAULT_TARGET, INT32_MAX, INT32_MIN, SAMPLING_FIELDS, SERVICE_NAME
from kvserve.contract import API_KEY_ENV, api_key_or_env

HEALTH_TIMEOUT_S = 5.0  # a probe answers within its own deadline, never hangs
_FLOATS = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)
_INT_RANGES = {  # what the proto field can hold: a flag outside it is a usage error, not a traceback
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
SAMPLING_HELP = {  # short forms of the field comments in llm.proto
    "temperature": "0 = greedy (default 1.0)",
    "top_p": "nucleus sampling, in (0, 1]",
    "top_k": "keep the k most likely tokens (0 = all)",
    "min_p": "drop tokens below min_p x the top probability, in [0, 1]",
    "seed": "same seed + prompt = same output",
    "max_tokens": "most tokens to generate (default: up to the model length)",
    "min_tokens": "no EOS / stop token before this many",
    "stop": "stop string, excluded from the output (repeat for more)",
    "stop_token_ids": "token id that ends the output (repeat for more)",
    "ignore_eos": "keep generating past EOS",
    "repetition_penalty": "> 1 discourages tokens already seen, in [0.01, 100]",
    "presence_penalty": "subtracted once from tokens already generated, in [-2, 2]",
    "frequency_penalty": "subtracted per occurrence from tokens already generated, in [-2, 2]",
    "logprobs": "log probabilities with this many top alternatives per token (0-20)",
    "skip_special_tokens": "leave special tokens out of the text (default on)",
    "cache_salt": "share prefix-cache blocks only with requests of the same salt",
    "speculative": "auto (default) or off: speculative decoding for this request, where the server has it",
    "max_draft_tokens": "most draft tokens verified per step for this request (0 = none)",
}


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete a prompt (whole or --stream)")
    _add_target(p)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    _add_priority(p)
    add_sampling_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (one turn, or interactive without a message)")
    _add_target(p)
    p.add_argument("message", nargs="?", help="the user message; omit for an interactive chat")
    p.add_argument("--system", help="a system message")
    _add_priority(p)
    add_sampling_flags(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("stats", help="print the server's Stats as JSON")
    _add_target(p)
    p.add_argument("--watch", type=int, metavar="MS", help="print a snapshot every MS milliseconds")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("health", help="a probe: exit 0 if the server answers SERVING, else 1",
                       description="Ask grpc.health.v1 Check: prints the status; exit status 0 only for "
                                   "SERVING (NOT_SERVING while the model loads or the server drains). For "
                                   "a server with TLS, give the same --tls-* flags as any client, or probe "
                                   "its plaintext `serve --health-port` instead. Health needs no API key.")
    _add_target(p, default_timeout=HEALTH_TIMEOUT_S)
    p.add_argument("--service", default=SERVICE_NAME,
                   help="the service to ask about ('' = the whole server; default %(default)s)")
    p.set_defaults(func=cmd_health)


def _add_target(p: argparse.ArgumentParser, default_timeout: float | None = None) -> None:
    p.add_argument("--target", default=os.environ.get("KVSERVE_TARGET", DEFAULT_TARGET),
                   help="server address host:port (env KVSERVE_TARGET; default %(default)s)")
    p.add_argument("--timeout", type=float, default=default_timeout,
                   help="deadline in seconds" + (" (default %(default)s)" if default_timeout else ""))
    g = p.add_argument_group("connection security")
    g.add_argument("--tls", action="store_true", help="connect over TLS (system CA roots unless --tls-ca)")
    g.add_argument("--tls-ca", metavar="PEM", help="CA that signed the server's certificate (implies --tls)")
    g.add_argument("--tls-cert", metavar="PEM", help="this client's certificate (mutual TLS)")
    g.add_argument("--tls-key", metavar="PEM", help="this client's private key (mutual TLS)")
    g.add_argument("--api-key", metavar="KEY", help=f"the server's --api-key (env {API_KEY_ENV})")


def _client(args: argparse.Namespace):
    """The client the connection flags describe."""
    from kvserve.clients.client import Client
    from kvserve.clients.messages import tls_credentials

    credentials = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        try:
            credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        except (OSError, ValueError) as e:
            raise SystemExit(f"kvserve: --tls-*: {e}") from None
    api_key = api_key_or_env(args.api_key)
    return Client(args.target, timeout=args.timeout, credentials=credentials, api_key=api_key)


def _add_priority(p: argparse.ArgumentParser) -> None:
    p.add_argument("--priority", type=_int_in(INT32_MIN, INT32_MAX), default=0, metavar="N",
                   help="order among this caller's own waiting work: lower runs earlier, as vLLM's "
                        "(GenerateRequest.priority, an int32; default 0)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field of llm.proto (unset = the server's default)."""
    g = p.add_argument_group("sampling (SamplingParams in proto/kvserve/v1/llm.proto)")
    for name, f in SAMPLING_FIELDS.items():
        flag = "--" + name.replace("_", "-")
        help_text = SAMPLING_HELP.get(name, name.replace("_", " "))
        if f.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        kind = float if f.cpp_type in _FLOATS else str
        if f.cpp_type in _INT_RANGES:
            kind = _int_in(*_INT_RANGES[f.cpp_type])
        elif f.cpp_type == FieldDescriptor.CPPTYPE_STRING and not f.is_repeated:
            kind = _text_or_file  # a schema, regex or grammar: text, or @FILE to read it from a file
        action = "append" if f.is_repeated else "store"
        g.add_argument(flag, dest=name, type=kind, action=action, help=help_text)


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its message
    return parse


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
    with _client(args) as client:
        return _rpc(lambda: _generate(client, args))


def _generate(client, args: argparse.Namespace) -> int:
    sampling = sampling_kwargs(args)
    if sampling.get("logprobs") and not args.json:
        return _generate_with_logprobs(client, args, sampling)
    if not args.stream:
        done = client.generate(args.prompt, priority=args.priority, **sampling)
        if args.json:
            print(json.dumps(_as_dict(done), indent=2))
        for choice in ([] if args.json else done.choices):
            if len(done.choices) > 1:
                print(f"--- choice {choice.index} ({choice.finish_reason}) ---")
            print(choice.text)
        return 0
    for delta in client.stream(args.prompt, priority=args.priority, **sampling):
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


def _generate_with_logprobs(client, args: argparse.Namespace, sampling: dict) -> int:
    """The text, then one line per token: its id, its text, its log probability and the top
    alternatives (id, text and log probability each)."""
    text, rows = [], []
    for delta in client.stream(args.prompt, priority=args.priority, **sampling):
        if args.stream:
            print(delta.text, end="", flush=True)
        text.append(delta.text)
        rows += delta.logprobs
    if not args.stream:
        print("".join(text), end="")
    print()
    print(f"{'id':>7} {'token':<16} {'logprob':>8}   top alternatives")
    for lp in rows:
        top = ", ".join(f"{t} {tok!r} {v:.3f}" for (t, v), tok in zip(lp.top, lp.top_tokens, strict=True))
        print(f"{lp.token_id:>7} {lp.token!r:<16} {lp.logprob:8.3f}   {top}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    history = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
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
    for delta in client.stream(messages=history, priority=args.priority, **sampling_kwargs(args)):
        reply.append(delta.text)
        print(delta.text, end="", flush=True)
    print()
    history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.watch is None:
            return _rpc(lambda: print(json.dumps(client.stats(), indent=2)) or 0)
        try:
            return _rpc(lambda: _watch(client, args.watch))
        except KeyboardInterrupt:
            return 0


def cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _rpc(lambda: _print_health(client.health(args.service)))


def _print_health(status: str) -> int:
    print(status)
    return 0 if status == "SERVING" else 1


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
