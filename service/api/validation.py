"""gRPC request -> engine request: field-by-field conversion and the checks that need no
tokenizer. Every error is a ``ValueError`` whose message names the field and the limit
(the servicer answers INVALID_ARGUMENT with it). Checks that need the tokenizer (prompt +
max_tokens over max_model_len, unknown chat roles) are done by the engine's ``add_request``.

This runs on the event loop, so the size of a repeated field is checked (``len()`` costs
nothing) before any of it becomes Python objects: a request of 15.9 M token ids (under the
16 MiB message limit) used to be copied into a list and walked id by id, stalling every
stream for a second and leaving hundreds of MiB behind. A prompt of ``max_model_len`` ids or
more can never run (it leaves no room for a completion), and every chat message adds at least
one token, so neither list is ever walked beyond ``max_model_len`` entries.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.contract import AUTHORIZATION, BEARER
from kvserve.engine.config import parse_weights
from kvserve.engine.sampling_params import SamplingParams
from kvserve.v1 import llm_pb2

MAX_REQUEST_ID_CHARS = 256
CACHE_SALT_SOURCES = ("none", "api-key", "header")
DEFAULT_CACHE_SALT_HEADER = "x-tenant-id"


@dataclass(frozen=True)
class CacheSalting:
    """Where the server takes a caller's prefix-cache salt from (``--cache-salt-from``): nowhere
    (only the request's own ``cache_salt``), the bearer credential in ``authorization``, or the
    metadata ``header``. The value is hashed (the engine never holds a key or a tenant name) and
    goes in front of the request's own salt, so a caller can split its own traffic further but
    never reach another caller's blocks. Callers without the credential or header share one salt
    of their own, apart from every caller who has one."""

    source: str = "none"
    header: str = DEFAULT_CACHE_SALT_HEADER

    def __post_init__(self) -> None:
        if self.source not in CACHE_SALT_SOURCES:
            raise ValueError(f"--cache-salt-from must be one of {', '.join(CACHE_SALT_SOURCES)}, "
                             f"got {self.source!r}")
        if not self.header or self.header != self.header.lower() or not self.header.isascii() \
                or any(c.isspace() or c == ":" for c in self.header):
            raise ValueError(f"--cache-salt-header must be a lower-case metadata key, got {self.header!r}")

    def salt(self, metadata: Iterable[tuple[str, str | bytes]] | None, own: str | None) -> str | None:
        """The salt a request runs with: the server's, derived from the call's metadata, then ``own``."""
        if self.source == "none":
            return own
        derived = self.tenant(metadata)
        return derived if own is None else f"{derived}\0{own}"

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's identity under this policy (hashed; "" when the policy is none: one tenant),
        which scopes its prefix-cache blocks and the requests it may abort."""
        if self.source == "none":
            return ""
        key = AUTHORIZATION if self.source == "api-key" else self.header
        value = next((v for k, v in metadata or () if k == key), "")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if self.source == "api-key" and value[: len(BEARER)].lower() == BEARER:
            value = value[len(BEARER):]
        return self.identity(value)

    def identity(self, value: str) -> str:
        """The tenant of a caller whose credential or header is ``value`` ("" = none given)."""
        return f"{self.source}:{hashlib.sha256(value.encode()).hexdigest() if value else ''}"

    def tenant_weights(self, weights: str | None) -> str | None:
        """``--tenant-weights`` ("NAME=W,..." by credential or header value) as the engine's
        ``tenant_weights``, by tenant identity: the engine never holds a key or a tenant name."""
        parsed = parse_weights(weights or "", "--tenant-weights")
        if parsed and self.source == "none":
            raise ValueError("--tenant-weights names tenants, which need --cache-salt-from api-key or header")
        return ",".join(f"{self.identity(name)}={w!r}" for name, w in parsed.items()) or None


def call_deadline(context) -> float | None:
    """The call's deadline on this process's ``time.monotonic()`` clock (None: the client set none);
    the engine refuses a request that cannot start or finish before it (engine/tenancy/deadlines.py)."""
    left = context.time_remaining()
    return None if left is None else time.monotonic() + left


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | list[int] | None  # text or token ids; None for chat
    messages: list[dict[str, str]] | None
    params: SamplingParams
    priority: int = 0  # lower = earlier among the tenant's work


def parse_generate_request(
    req: llm_pb2.GenerateRequest, vocab_size: int, sampling_defaults: dict | None = None,
    header_request_id: str | None = None, max_model_len: int | None = None,
) -> EngineRequest:
    """Check and convert a GenerateRequest; raises ValueError naming the bad field.
    ``sampling_defaults`` (the model's recommended sampling) fill the fields the request leaves unset.
    The request id is the ``request_id`` field, else the call's ``x-request-id`` metadata, else a new one.
    ``max_model_len`` (None: unchecked here) bounds the token ids and the chat messages."""
    request_id = req.request_id or header_request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        field = "request_id" if req.request_id else "x-request-id"
        raise ValueError(f"{field}: at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    prompt, messages = _parse_input(req, vocab_size, max_model_len)
    params = sampling_from_proto(req.sampling, sampling_defaults).validate(vocab_size)
    return EngineRequest(request_id, prompt, messages, params, req.priority)


def parse_tokenize_request(req: llm_pb2.TokenizeRequest, max_model_len: int | None = None,
                           ) -> tuple[str | None, list[dict[str, str]] | None]:
    """(prompt, messages) of a TokenizeRequest, one of them None; ValueError naming the field."""
    return _parse_input(req, 0, max_model_len)  # no token_ids: the only input that needs the vocabulary


def _parse_input(req: llm_pb2.GenerateRequest | llm_pb2.TokenizeRequest, vocab_size: int,
                 max_model_len: int | None):
    which = req.WhichOneof("input")
    if which is None:
        raise ValueError("input: give one of prompt, token_ids or messages")
    if which == "prompt":
        if not req.prompt:
            raise ValueError("prompt: must not be empty")
        return req.prompt, None
    if which == "token_ids":
        n = len(req.token_ids.ids)
        if not n:
            raise ValueError("token_ids.ids: must not be empty")
        if max_model_len is not None and n >= max_model_len:
            raise ValueError(f"token_ids.ids: {n} ids leave no room for a completion: a prompt must be "
                             f"shorter than max_model_len ({max_model_len} tokens)")
        ids = list(req.token_ids.ids)
        top = max(ids)  # one pass in C, not a Python loop per id
        if top >= vocab_size:
            raise ValueError(f"token_ids.ids: id {top} is outside the vocabulary [0, {vocab_size})")
        return ids, None
    n = len(req.messages.messages)
    if not n:
        raise ValueError("messages.messages: must not be empty")
    if max_model_len is not None and n > max_model_len:
        raise ValueError(f"messages.messages: {n} messages cannot fit max_model_len ({max_model_len} tokens; "
                         f"every message adds at least one token)")
    return None, [{"role": m.role, "content": m.content} for m in req.messages.messages]


def sampling_from_proto(msg: llm_pb2.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Fields set in the message override ``defaults``, then SamplingParams' own defaults."""
    kwargs = dict(defaults or {})
    for f in msg.DESCRIPTOR.fields:
        if f.is_repeated:
            kwargs[f.name] = list(getattr(msg, f.name))
        elif msg.HasField(f.name):
            kwargs[f.name] = getattr(msg, f.name)
    return SamplingParams(**kwargs)

