"""Tensor-parallel plumbing under the executor: rendezvous, process groups, and the command
channels that carry the leader's commands to the workers.

Every rank joins two process groups: the *world* group carries the numbers (the layers'
all-reduce and gather; NCCL on GPU, gloo on CPU) and a gloo *control* group carries small
CPU-side messages (the start-up handshake and, across machines, the command stream). The
rendezvous is a TCPStore on ``master_addr``: on a configured ``master_port``, or on a port
the operating system picks (bound once, so no other process can take it in between).

A command is a name plus a body of bytes (``ModelInput.to_bytes()`` is JSON); nothing is
ever pickled. Two channels carry the same commands, with the same size limit:

- ``ShmSender`` / ``ShmReceiver`` (one machine): a POSIX shared-memory segment, owner-only
  and unlinked on close, holding a header (sequence number, payload length), one
  "consumed" counter per worker, then the payload; the leader rings one doorbell per worker.
  The leader never overwrites a payload a worker has not copied yet. A doorbell is a
  semaphore rather than an Event: ``multiprocessing.Event.set()`` waits for every sleeping
  waiter to acknowledge, so a worker killed while waiting would hang the leader forever.
- ``DistSender`` / ``DistReceiver`` (any number of machines): the leader broadcasts a
  header tensor (sequence number, length) and then the payload bytes on the control group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kvserve.engine.config import EngineConfig

DEFAULT_TIMEOUT_S = 600.0  # rendezvous and one collective; dead workers are caught much sooner
DEFAULT_MAX_PAYLOAD = 16 * 2**20  # bytes of one command; shared memory is only touched as used
LAUNCH_KEY = "kvserve/launch"

EXECUTE_MODEL = "execute_model"
SHUTDOWN = "shutdown"
PING = "ping"  # keeps idle workers' waits on the control group inside their timeout

_HEADER = struct.Struct("<QQ")  # sequence number, payload length
_SLOT = struct.Struct("<Q")  # per worker: sequence number of the last command it copied


class PayloadTooLargeError(ValueError):
    """A command does not fit the channel; nothing was sent."""


@dataclass(frozen=True)
class Command:
    name: str
    body: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.name) + 1 + len(self.body)

    def encode(self) -> bytes:
        return self.name.encode("ascii") + b"\0" + self.body

    @classmethod
    def decode(cls, frame: bytes) -> Command:
        name, _, body = frame.partition(b"\0")
        return cls(name.decode("ascii"), body)


def check_payload_size(nbytes: int, limit: int) -> None:
    if nbytes > limit:
        raise PayloadTooLargeError(
            f"tensor-parallel command of {nbytes} bytes exceeds the channel limit of {limit} bytes "
            "(max_payload_bytes); schedule fewer tokens per step (max_num_batched_tokens, "
            "max_num_seqs) or raise the limit"
        )


# ---- rendezvous and process groups -------------------------------------------------------------
def resolve_channel(config: EngineConfig) -> str:
    """"shm" or "dist" for ``config.tp_channel``; shared memory only works on one machine."""
    if config.tp_channel == "auto":
        return "shm" if config.nnodes == 1 else "dist"
    if config.tp_channel == "shm" and config.nnodes > 1:
        raise ValueError(f"tp_channel='shm' works on one machine only, got nnodes={config.nnodes}")
    return config.tp_channel


def collective_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def listen_store(addr: str, port: int | None, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The leader's rendezvous store, listening on ``addr`` only; port 0/None lets the OS pick."""
    sock = socket.create_server((addr, port or 0))
    chosen = sock.getsockname()[1]
    # the store takes over the bound socket, so the chosen port cannot be lost to another process
    return dist.TCPStore(
        addr, chosen, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=sock.detach(),
    )


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Launch:
    """What the leader tells every worker through the store: one config for all ranks."""

    config: EngineConfig
    max_payload: int = DEFAULT_MAX_PAYLOAD
    timeout_s: float = DEFAULT_TIMEOUT_S

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Launch:
        fields = json.loads(text)
        return cls(EngineConfig(**fields.pop("config")), **fields)


def publish_launch(store: dist.TCPStore, launch: Launch) -> None:
    store.set(LAUNCH_KEY, launch.to_json())


def fetch_launch(store: dist.TCPStore) -> Launch:
    """The leader's launch record; waits for it up to the store's timeout."""
    return Launch.from_json(store.get(LAUNCH_KEY))


def announce_rank(store: dist.TCPStore, rank: int) -> None:
    """A worker is about to join the process groups."""
    store.set(f"kvserve/joining/{rank}", "1")


def wait_for_ranks(store: dist.TCPStore, ranks: Iterable[int], cancelled: Callable[[], bool],
                   timeout_s: float) -> None:
    """Wait until every rank announced itself (joining then takes milliseconds), or cancel."""
    pending = {rank: f"kvserve/joining/{rank}" for rank in ranks}
    deadline = time.monotonic() + timeout_s
    while pending and not store.check(list(pending.values())):
        if cancelled():
            raise RuntimeError("tensor-parallel start-up cancelled")
        if time.monotonic() > deadline:
            missing = [rank for rank, key in pending.items() if not store.check([key])]
            raise TimeoutError(f"tensor-parallel ranks {missing} did not join within {timeout_s:.0f} s; "
                               "on other machines start them with `kvserve worker --node-rank R`")
        time.sleep(0.05)


def report_error(store: dist.TCPStore, rank: int, exc: BaseException) -> None:
    """Leave a worker's fatal error where the leader can quote it."""
    # the leader may already be gone; the traceback still goes to stderr
    with contextlib.suppress(Exception):
        store.set(f"kvserve/error/{rank}", f"{type(exc).__name__}: {exc}")


def reported_error(store: dist.TCPStore, rank: int) -> str | None:
    key = f"kvserve/error/{rank}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:
        return None


def init_groups(
    store: dist.TCPStore, rank: int, world_size: int, backend: str, timeout_s: float
) -> tuple[Any, Any]:
    """Join the world group (numbers) and the gloo control group; returns (world, control)."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: "
            "one tensor-parallel engine per process (shut the other one down first)"
        )
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return dist.group.WORLD, control


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_min(value: int, group: Any) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# ---- command channels ---------------------------------------------------------------------------
class Sender(Protocol):
    max_payload: int

    def send(self, cmd: Command) -> None: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self) -> Command: ...

    def close(self) -> None: ...


def _next_seq(current: int, found: int) -> int:
    if found != current + 1:
        raise RuntimeError(f"tensor-parallel command channel out of step: expected command "
                           f"{current + 1}, got {found}")
    return found


class ShmSender:
    """Leader side of the shared-memory channel."""

    def __init__(self, doorbells: list, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        """``doorbells``: one ``multiprocessing`` Semaphore(0) per worker, in rank order."""
        self.max_payload = max_payload
        self._doorbells = doorbells
        self._timeout_s = timeout_s
        self._offset = _HEADER.size + _SLOT.size * len(doorbells)
        # CPython creates POSIX segments with mode 0o600: owner-only (tests check the mode); the
        # leader's pid in the name tells whose a segment is (a leaked one, or another engine's)
        self._shm = SharedMemory(name=f"kvserve-tp-{os.getpid()}-{uuid.uuid4().hex[:16]}", create=True,
                                 size=self._offset + max_payload)
        self._seq = 0
        self._closed = False

    @property
    def name(self) -> str:
        return self._shm.name

    def send(self, cmd: Command) -> None:
        check_payload_size(cmd.nbytes, self.max_payload)
        self._wait_consumed()
        frame = cmd.encode()
        buf = self._shm.buf
        buf[self._offset:self._offset + len(frame)] = frame
        self._seq += 1
        _HEADER.pack_into(buf, 0, self._seq, len(frame))
        for doorbell in self._doorbells:
            doorbell.release()

    def _wait_consumed(self) -> None:
        """Every worker has copied the previous command (in lock-step running, at once)."""
        deadline = time.monotonic() + self._timeout_s
        while any(self._consumed(i) != self._seq for i in range(len(self._doorbells))):
            if self._closed:
                raise RuntimeError("the tensor-parallel command channel is closed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"a tensor-parallel worker did not take command {self._seq} "
                                   f"within {self._timeout_s:.0f} s")
            time.sleep(0.0002)

    def _consumed(self, index: int) -> int:
        return _SLOT.unpack_from(self._shm.buf, _HEADER.size + _SLOT.size * index)[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()


def attach_untracked(name: str) -> SharedMemory:
    """The leader's segment, attached without registering it with this process's resource
    tracker: before Python 3.13 attaching registers it, and at exit that tracker warns of a
    "leaked" segment and tries to unlink what the leader already unlinked. (Unregistering after
    the fact would also drop the creator's registration where both live in one process: the
    tracker keeps names, not counts.)"""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # SharedMemory looks it up at call time
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class ShmReceiver:
    """Worker side of the shared-memory channel; ``index`` is rank - 1."""

    def __init__(self, name: str, index: int, doorbell, num_workers: int):
        self._shm = attach_untracked(name)
        self._index = index
        self._doorbell = doorbell
        self._offset = _HEADER.size + _SLOT.size * num_workers
        self._seq = 0

    def recv(self) -> Command:
        self._doorbell.acquire()
        buf = self._shm.buf
        seq, length = _HEADER.unpack_from(buf, 0)
        self._seq = _next_seq(self._seq, seq)
        check_payload_size(length, len(buf) - self._offset)
        frame = bytes(buf[self._offset:self._offset + length])
        _SLOT.pack_into(buf, _HEADER.size + _SLOT.size * self._index, seq)
        return Command.decode(frame)

    def close(self) -> None:
        self._shm.close()


class DistSender:
    """Leader side of the torch.distributed channel (control group, broadcast from rank 0)."""

    def __init__(self, group: Any, max_payload: int = DEFAULT_MAX_PAYLOAD):
        self.max_payload = max_payload
        self._group = group
        self._seq = 0

    def send(self, cmd: Command) -> None:
        check_payload_size(cmd.nbytes, self.max_payload)
        frame = cmd.encode()
        self._seq += 1
        header = torch.tensor([self._seq, len(frame)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), src=0, group=self._group)

    def close(self) -> None:
        pass


class DistReceiver:
    """Worker side of the torch.distributed channel."""

    def __init__(self, group: Any, max_payload: int = DEFAULT_MAX_PAYLOAD):
        self._group = group
        self._max_payload = max_payload
        self._seq = 0

    def recv(self) -> Command:
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        seq, length = (int(v) for v in header.tolist())
        self._seq = _next_seq(self._seq, seq)
        check_payload_size(length, self._max_payload)
        frame = torch.empty(length, dtype=torch.uint8)
        dist.broadcast(frame, src=0, group=self._group)
        return Command.decode(frame.numpy().tobytes())

    def close(self) -> None:
        pass
