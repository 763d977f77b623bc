"""KV-cache events on the front-end's side: numbered batches for the routers that follow a
server's prefix cache (SMG's cache-aware policy, llm-d's precise prefix scorer).

The engine core appends a tuple per change of its prefix-cache table (engine/core/block_manager.py)
and sends a step's tuples with its ``StepDone``. ``KvEventHub.publish`` turns them into one batch:
blocks stored one after another along a chain become one ``BlockStored`` (hashes, the parent of
the first, the token ids of all, the block size), runs of removals one ``BlockRemoved``, a flush
``AllBlocksCleared``. Hashes go out as signed 64-bit integers (xxhash64's unsigned value minus
2**64 when it is at least 2**63), which both int64 (SMG) and uint64 (llm-d) readers take.

A batch goes to
- the ZeroMQ PUB socket (``--kv-events-endpoint``) in vLLM's wire format: the frames (topic,
  8-byte big-endian sequence number, msgpack ``EventBatch{ts, events, data_parallel_rank}``
  whose events are maps tagged by ``"type"``);
- the optional ROUTER replay socket (``--kv-events-replay-endpoint``): a request of an 8-byte
  start sequence is answered with every buffered (sequence, payload) from there on, then -1;
- every ``subscribe`` iterator (the SubscribeKvEvents RPC).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvserve.engine.kv_cache.blocks import CLEARED, REMOVED, STORED

log = logging.getLogger("kvserve.engine.kv_events")

REPLAY_BUFFER = 10_000  # batches kept for replay (vLLM's default)
SUBSCRIBER_QUEUE = 10_000  # batches a slow SubscribeKvEvents reader may fall behind before it is dropped
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MALFORMED_LOG_S = 60.0  # malformed replay requests are logged at most this often


def signed64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


# ---- vLLM's msgpack schema (vllm/distributed/kv_events.py): maps, events tagged by class name ----
class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # no defaults, so always encoded (as nil), as vLLM's struct does; kvserve has no LoRA and one medium
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # a model with KV cache groups (engine/kv_cache/groups.py): the block's group and its spec
    # ("full_attention" or "sliding_window", and the window); left out otherwise
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass
class KvBatch:
    sequence: int
    timestamp: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def group_events(raw: list, block_size: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The core's tuples as vLLM's events, chained stores and consecutive removals merged."""
    events: list = []
    last_hash = None
    for item in raw:
        kind = item[0]
        prev = events[-1] if events else None
        if kind == STORED:
            _, h, parent, tokens, *group = item
            if (isinstance(prev, BlockStored) and parent is not None and parent == last_hash
                    and prev.group_idx == (group[0] if group else None)):
                prev.block_hashes.append(signed64(h))
                prev.token_ids.extend(tokens)
            else:
                events.append(BlockStored([signed64(h)], None if parent is None else signed64(parent),
                                          list(tokens), block_size, None, None, None, *_spec(group)))
            last_hash = h
            continue
        last_hash = None
        if kind == REMOVED:
            group = item[2] if len(item) > 2 else None
            if isinstance(prev, BlockRemoved) and prev.group_idx == group:
                prev.block_hashes.append(signed64(item[1]))
            else:
                events.append(BlockRemoved([signed64(item[1])], None, group))
        elif kind == CLEARED:
            events.append(AllBlocksCleared())
    return events


def _spec(group: list) -> tuple:
    """(group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window) of a store's (group, window)."""
    if not group:
        return ()
    index, window = group
    return index, "full_attention" if window is None else "sliding_window", window


def encode_vllm(batch: KvBatch) -> bytes:
    """The msgpack payload vLLM's publisher sends for ``batch`` (data-parallel rank 0)."""
    return msgspec.msgpack.encode(EventBatch(batch.timestamp, batch.events, 0))


class KvEventHub:
    """Numbers the batches and hands them to the PUB socket, the replay buffer and subscribers."""

    def __init__(self, block_size: int, endpoint: str | None = None, replay_endpoint: str | None = None,
                 topic: str = ""):
        self.block_size = block_size
        self.topic = topic.encode()
        self._next_seq = 0
        self._buffer: collections.deque[KvBatch] = collections.deque(maxlen=REPLAY_BUFFER)
        self._payloads: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BUFFER)
        self._subscribers: set[asyncio.Queue] = set()
        self._ctx = zmq.asyncio.Context() if (endpoint or replay_endpoint) else None
        self._pub = self._bind(zmq.PUB, endpoint) if endpoint else None
        self._replay = self._bind(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self._replay_task = asyncio.ensure_future(self._serve_replay()) if self._replay is not None else None

    def _bind(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            raise OSError(f"cannot bind the KV-events socket to {endpoint}: {e}") from e
        return sock

    @property
    def next_sequence(self) -> int:
        return self._next_seq

    def publish(self, raw: list) -> None:
        """One step's events from the core (nothing is sent for a step without any)."""
        events = group_events(raw, self.block_size)
        if not events:
            return
        batch = KvBatch(self._next_seq, time.time(), events)
        self._next_seq += 1
        self._buffer.append(batch)
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(batch)
            except asyncio.QueueFull:  # a reader this far behind gets an end, not unbounded memory
                self._subscribers.discard(queue)  # ``subscribe`` ends it once it drained its queue
        if self._pub is not None or self._replay is not None:
            payload = encode_vllm(batch)
            self._payloads.append((batch.sequence, payload))
            if self._pub is not None:
                # PUB drops at its high-water mark; subscribers can replay what they missed
                with contextlib.suppress(zmq.Again):
                    self._pub.send_multipart((self.topic, batch.sequence.to_bytes(8, "big"), payload),
                                             flags=zmq.NOBLOCK)

    async def subscribe(self, start_sequence: int = 0) -> AsyncIterator[KvBatch]:
        """Batches from ``start_sequence`` (those still buffered; 0 = only new ones) on, forever.
        Raises ``OverflowError`` if the reader falls ``SUBSCRIBER_QUEUE`` batches behind."""
        queue: asyncio.Queue = asyncio.Queue(SUBSCRIBER_QUEUE)
        backlog = [b for b in self._buffer if start_sequence and b.sequence >= start_sequence]
        self._subscribers.add(queue)
        try:
            for batch in backlog:
                yield batch
            seen = backlog[-1].sequence if backlog else -1
            while True:
                if queue not in self._subscribers and queue.empty():
                    raise OverflowError(f"KV-event subscriber fell {SUBSCRIBER_QUEUE} batches behind")
                batch = await queue.get()
                if batch.sequence > seen:
                    yield batch
        finally:
            self._subscribers.discard(queue)

    async def _serve_replay(self) -> None:
        malformed, warned = 0, -MALFORMED_LOG_S
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                malformed += 1  # the socket takes anyone's frames: one line a minute, not one a frame
                if time.monotonic() - warned >= MALFORMED_LOG_S:
                    log.warning("ignored %d malformed KV-event replay request(s) (the last had %d frames)",
                                malformed, len(frames))
                    malformed, warned = 0, time.monotonic()
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._payloads):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
