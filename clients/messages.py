"""Client-side request building and result types, shared by the sync and asyncio clients.

Sampling keywords are the field names of ``SamplingParams`` in llm.proto (``temperature``,
``max_tokens``, ``stop``, ...); unset ones take the server's defaults.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from kvserve.v1 import llm_pb2

SAMPLING_FIELDS: dict[str, FieldDescriptor] = {f.name: f for f in llm_pb2.SamplingParams.DESCRIPTOR.fields}
SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
DEFAULT_TARGET = "127.0.0.1:50051"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# Keys gRPC core reads. The server allows a ping every 10 s; we ping an idle-looking
# connection every 30 s so that a dead server is noticed during a long call.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]

Message = Mapping[str, str] | tuple[str, str]


def open_channel(api, target: str, credentials=None):
    """A channel to ``target`` with the client options; ``api`` is ``grpc`` or ``grpc.aio``."""
    if credentials is None:
        return api.insecure_channel(target, options=CHANNEL_OPTIONS)
    return api.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None):
    """Channel credentials for a TLS server, from PEM files: ``ca`` the CA that signed the
    server's certificate (None = the system's roots); ``cert`` + ``key`` this client's own
    certificate, for a server that asks for one (mutual TLS)."""
    import grpc

    if (cert is None) != (key is None):
        raise ValueError("tls cert and key: give both (or neither)")

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path is not None else None

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_draft_tokens: int = 0  # of which accepted


@dataclass
class Timing:
    queue_ms: float
    ttft_ms: float
    total_ms: float


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    token: str = ""  # the chosen token's text, decoded alone
    top_tokens: list[str] = field(default_factory=list)  # the text of each entry of ``top``


@dataclass
class Choice:
    """One of the n completions of a prompt (``sampling`` keyword ``n``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob]


@dataclass
class Completion:
    """A whole completion (``generate``); with n > 1 the fields are choice 0's (usage: prompt
    counted once, completion tokens of all choices), and ``choices`` has every one."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "STOP", "STOP_STRING", "LENGTH" or "ABORT"
    usage: Usage
    timing: Timing
    logprobs: list[TokenLogprob]
    choices: list[Choice] = field(default_factory=list)  # all n completions (one when n = 1)


@dataclass
class Delta:
    """One streamed piece (``stream``); the last one has finish_reason, usage and timing."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    index: int = 0  # which completion (0 .. n-1) this piece belongs to

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Message] | None = None,
    request_id: str = "",
    priority: int = 0,
    **sampling,
) -> llm_pb2.GenerateRequest:
    """A GenerateRequest from exactly one of prompt / token_ids / messages and sampling keywords.
    ``priority`` orders the caller's own work (lower runs earlier, as vLLM's; docs/serving/tenants.md)."""
    req = _with_input(llm_pb2.GenerateRequest(request_id=request_id, priority=check_priority(priority)),
                      prompt=prompt, token_ids=token_ids, messages=messages)
    req.sampling.CopyFrom(sampling_params(**sampling))
    return req


def check_priority(priority: int) -> int:
    """``priority`` as GenerateRequest.priority holds it (an int32); a clear error otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority: an integer, got {type(priority).__name__} {priority!r}")
    if not INT32_MIN <= priority <= INT32_MAX:
        raise ValueError(f"priority: must be in [{INT32_MIN}, {INT32_MAX}] (int32), got {priority}")
    return priority


def build_tokenize_request(prompt: str | None = None, messages: Iterable[Message] | None = None
                           ) -> llm_pb2.TokenizeRequest:
    """A TokenizeRequest from exactly one of prompt / messages."""
    return _with_input(llm_pb2.TokenizeRequest(), prompt=prompt, messages=messages)


def _with_input(req, **inputs):
    """``req`` with its ``input`` oneof set from the one of ``inputs`` that is not None."""
    given = [name for name, v in inputs.items() if v is not None]
    if len(given) != 1:
        raise TypeError(f"give exactly one of {', '.join(inputs)} (got {given or 'none'})")
    (name,) = given
    if name == "prompt":
        req.prompt = inputs[name]
    elif name == "token_ids":
        req.token_ids.ids.extend(inputs[name])
    else:
        req.messages.messages.extend(_chat_message(m) for m in inputs[name])
    return req


def sampling_params(**sampling) -> llm_pb2.SamplingParams:
    """A SamplingParams message; keywords set to None are left unset (server default)."""
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise TypeError(f"unknown sampling option(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}")
    msg = llm_pb2.SamplingParams()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)  # a schema given as a dict
        if SAMPLING_FIELDS[name].is_repeated:
            getattr(msg, name).extend([value] if isinstance(value, str | int) else value)
        else:
            setattr(msg, name, value)
    return msg


def _chat_message(m: Message) -> llm_pb2.ChatMessage:
    if isinstance(m, tuple):
        return llm_pb2.ChatMessage(role=m[0], content=m[1])
    return llm_pb2.ChatMessage(role=m["role"], content=m["content"])


def finish_reason_name(value: int) -> str | None:
    return None if value == llm_pb2.FINISH_REASON_UNSPECIFIED else llm_pb2.FinishReason.Name(value)


def _logprobs(msgs) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top], m.token,
                         [t.token for t in m.top]) for m in msgs]


def _usage(u: llm_pb2.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.draft_tokens,
                 u.accepted_draft_tokens)


def _timing(t: llm_pb2.Timing) -> Timing:
    return Timing(t.queue_ms, t.ttft_ms, t.total_ms)


def _choice(msg: llm_pb2.Choice | llm_pb2.GenerateResponse, index: int) -> Choice:
    return Choice(index, msg.text, list(msg.token_ids), finish_reason_name(msg.finish_reason) or "",
                  _usage(msg.usage), _logprobs(msg.logprobs))


def completion_from_proto(msg: llm_pb2.GenerateResponse) -> Completion:
    top = _choice(msg, 0)  # the top-level fields: choice 0's (usage: of all choices, see llm.proto)
    return Completion(
        request_id=msg.request_id,
        text=top.text,
        token_ids=top.token_ids,
        finish_reason=top.finish_reason,
        usage=top.usage,
        timing=_timing(msg.timing),
        logprobs=top.logprobs,
        choices=[_choice(c, c.index) for c in msg.choices] or [top],
    )


def delta_from_proto(msg: llm_pb2.StreamResponse) -> Delta:
    reason = finish_reason_name(msg.finish_reason)
    return Delta(
        request_id=msg.request_id,
        text=msg.text,
        token_ids=list(msg.token_ids),
        logprobs=_logprobs(msg.logprobs),
        finish_reason=reason,
        usage=_usage(msg.usage) if reason else None,
        timing=_timing(msg.timing) if reason else None,
        index=msg.index,
    )


def stats_to_dict(msg: llm_pb2.StatsResponse | llm_pb2.ModelInfoResponse) -> dict:
    """Every field, zeros included, with native Python numbers (64-bit ints stay ints, repeated
    fields are lists)."""
    return {f.name: list(getattr(msg, f.name)) if f.is_repeated else getattr(msg, f.name)
            for f in msg.DESCRIPTOR.fields}

