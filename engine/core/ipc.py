"""The messages between the service's front-end and the engine-core process, and their codec.

Both directions are msgpack (msgspec) over ZeroMQ PUSH/PULL sockets on ``ipc://`` paths; no
pickle crosses the boundary. The front-end sends ``ToCore`` batches: the new requests (already
tokenized), the aborts and the calls (e.g. ``stats``) gathered during one turn of its event
loop. The core sends one ``StepDone`` per engine step: every request's delta of that step
(``RequestOutput``: new token ids, text and logprobs, and on the last one the finish reason and
usage), the requests it refused, the calls' answers and the step's KV-cache events; when idle
it sends an empty one every ``HEARTBEAT_S`` seconds, so a silent core is a stuck core.
``Ready`` comes once the model is loaded, ``Failed`` when the core gives up.
"""

from __future__ import annotations

import msgspec

from kvserve.engine.config import EngineConfig
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

HEARTBEAT_S = 1.0  # an idle core reports this often


class NewRequest(msgspec.Struct, array_like=True):
    key: str  # unique per request in this front-end (the client's request_id may repeat)
    prompt_token_ids: list[int]
    params: SamplingParams


class StopChoice(msgspec.Struct, array_like=True):
    key: str
    index: int  # the choice whose stop string the front-end found (SamplingParams.n)


class Call(msgspec.Struct, array_like=True):
    call_id: int
    name: str  # one of CALLS


CALLS = ("stats", "model_info", "enable_kv_events", "reset_prefix_cache")


class ToCore(msgspec.Struct, array_like=True):
    seq: int  # numbers the batches; the core acknowledges the last one it applied
    new: list[NewRequest] = []
    aborts: list[str] = []
    calls: list[Call] = []
    stops: list[StopChoice] = []
    shutdown: bool = False


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    vocab_size: int
    config: EngineConfig  # as resolved by the core (max_model_len filled in)


class Rejected(msgspec.Struct, array_like=True):
    key: str
    message: str  # names the field and the limit (INVALID_ARGUMENT)


class Reply(msgspec.Struct, array_like=True):
    call_id: int
    result: dict


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
