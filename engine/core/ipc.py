"""The messages between the service's front-end and the engine-core process, and their codec.

Both directions are msgpack (msgspec) over ZeroMQ PUSH/PULL sockets on ``ipc://`` paths; no
pickle crosses the boundary. The front-end sends ``ToCore`` batches: the new requests (already
tokenized), the aborts and the calls (e.g. ``stats``) gathered during one turn of its event
loop. The core sends one ``StepDone`` per engine step: every request's delta of that step
(``RequestOutput``: new token ids, text and logprobs, and on the last one the finish reason and
usage), the requests it refused, the calls' answers and the step's KV-cache events; when idle
it sends an empty one every ``HEARTBEAT_S`` seconds, so a silent core is a stuck core.
``Ready`` comes once the model is loaded, with the model's facts; ``Failed`` when the core gives
up. Stats, model facts and call answers are typed structs, so a field renamed on one side fails
to decode instead of going missing on the other.
"""

from __future__ import annotations

import msgspec

from kvserve.engine.config import EngineConfig
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.tenancy.accounts import TenantStats

HEARTBEAT_S = 1.0  # an idle core reports this often


class NewRequest(msgspec.Struct, array_like=True):
    key: str  # unique per request in this front-end (the client's request_id may repeat)
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = ""  # the caller's tenant, hashed ("" = the server has no tenants)
    priority: int = 0  # lower = earlier
    timeout_s: float | None = None  # seconds left to the call's deadline when sent; None: no deadline


class StopChoice(msgspec.Struct, array_like=True):
    key: str
    index: int  # the choice whose stop string the front-end found (SamplingParams.n)


class Call(msgspec.Struct, array_like=True):
    call_id: int
    name: str  # one of CALLS


CALLS = ("stats", "enable_kv_events", "reset_prefix_cache")


class ToCore(msgspec.Struct, array_like=True):
    seq: int  # numbers the batches; the core acknowledges the last one it applied
    new: list[NewRequest] = []
    aborts: list[str] = []
    calls: list[Call] = []
    stops: list[StopChoice] = []
    shutdown: bool = False


class ModelFacts(msgspec.Struct, kw_only=True, tag="model_info"):
    """What the core knows of the loaded model (ModelInfo, the vLLM API's GetModelInfo); fixed
    once loaded, so it comes with ``Ready`` and the front-end answers from it."""

    model: str  # the name the engine reports (file or directory it was loaded from)
    model_dir: str  # the local directory holding the model's files
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    tp_size: int
    eos_token_ids: list[int]
    kv_block_size: int
    kv_cache_dtype: str  # "int8", or the serving dtype's name
    quantization: str  # "int8" / "int4" (--quantization), or "" for weights in dtype
    # the model's recommended sampling for unset fields (engine/model_loader/generation_defaults.py)
    sampling_defaults: dict[str, float | int] = {}
    # what each kind of weight is multiplied in, "<name>=<formats>" (engine/layers/gguf_linear.py)
    weight_formats: list[str] = []


class EngineStats(msgspec.Struct, kw_only=True, tag="stats"):
    """The core's state and counters since start (Stats, /metrics, the vLLM API's GetLoad)."""

    model: str
    device: str
    dtype: str
    tp_size: int
    attention_backend: str
    num_waiting: int  # the scheduler's waiting queue (and grammars compiling)
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int  # prefix-cached blocks that are free count here
    kv_block_size: int
    kv_cache_dtype: str
    # models with linear-attention layers: the slots of their per-sequence state and its memory,
    # part of the KV cache's (engine/runner/state_cache.py); 0 for other models
    state_slots_total: int = 0
    state_slots_free: int = 0
    state_snapshots_total: int = 0  # rows for prefix caching's states (as many as slots; 0: it is off)
    state_snapshots_cached: int = 0
    state_snapshot_hits: int = 0  # admissions that resumed from a snapshot
    state_cache_bytes: int = 0
    prefix_cache_hit_rate: float
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    requests_finished: int
    requests_aborted: int
    prompt_tokens_total: int
    generation_tokens_total: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_acceptance_rate: float
    spec_decode_mean_accepted_length: float  # tokens a verification step emits per sequence
    uptime_s: float
    tenants: list[TenantStats] = []  # per tenant, at most MAX_TENANT_LABELS and "other" (/metrics only)


class CacheFlush(msgspec.Struct, kw_only=True, tag="flush"):
    """``reset_prefix_cache``'s answer (FlushCache): refused while requests hold blocks."""

    success: bool
    message: str = ""


class Ready(msgspec.Struct, tag="ready", array_like=True):
    facts: ModelFacts
    config: EngineConfig  # as resolved by the core (max_model_len filled in)


REJECTIONS = ("invalid", "unavailable", "overloaded", "deadline")


class Rejected(msgspec.Struct, array_like=True):
    key: str
    message: str  # names the field and the limit
    # invalid: the request's fault (INVALID_ARGUMENT); unavailable: the server's (a grammar compiler
    # that died: UNAVAILABLE); overloaded: a tenant's cap (RESOURCE_EXHAUSTED); deadline: it cannot
    # start before its deadline (DEADLINE_EXCEEDED)
    kind: str = "invalid"


class Reply(msgspec.Struct, array_like=True):
    call_id: int
    result: EngineStats | CacheFlush | None  # what the call named returns


class StepDone(msgspec.Struct, tag="step", array_like=True):
    acked: int  # the last ToCore.seq applied before num_waiting was read
    num_waiting: int  # the scheduler's waiting queue after this step
    outputs: list[RequestOutput] = []
    rejected: list[Rejected] = []
    replies: list[Reply] = []
    # the step's KV-cache events (block_manager's tuples), once the front-end enabled them
    kv_events: list[tuple] = []


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str


FromCore = Ready | StepDone | Failed


class Codec:
    """Reusable encoder and decoders (msgspec's are fastest when kept)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_core = msgspec.msgpack.Decoder(ToCore)
        self._from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg: ToCore | Ready | StepDone | Failed) -> bytes:
        return self._encoder.encode(msg)

    def decode_to_core(self, data: bytes) -> ToCore:
        return self._to_core.decode(data)

    def decode_from_core(self, data: bytes) -> Ready | StepDone | Failed:
        return self._from_core.decode(data)
