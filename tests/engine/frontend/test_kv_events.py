"""KV-cache events on the front-end: the core's tuples grouped as vLLM's events, their msgpack
payload as an independent decoder (msgpack) reads it, the ZeroMQ PUB frames, the replay socket
and the subscribers' iterators."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import zmq
import zmq.asyncio

from kvserve.engine.frontend.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEventHub,
    encode_vllm,
    group_events,
    signed64,
)
from kvserve.engine.kv_cache.blocks import CLEARED, REMOVED, STORED, block_hash

BS = 4
H0 = block_hash(None, (1, 2, 3, 4))
H1 = block_hash(H0, (5, 6, 7, 8))
HX = block_hash(None, (9, 9, 9, 9))
RAW = [(STORED, H0, None, (1, 2, 3, 4)), (STORED, H1, H0, (5, 6, 7, 8)), (STORED, HX, None, (9, 9, 9, 9)),
       (REMOVED, H0), (REMOVED, HX), (CLEARED,)]


def test_chained_stores_and_runs_of_removals_are_merged_with_signed_hashes():
    events = group_events(RAW, BS)
    assert events == [
        BlockStored([signed64(H0), signed64(H1)], None, [1, 2, 3, 4, 5, 6, 7, 8], BS, None, None, None),
        BlockStored([signed64(HX)], None, [9, 9, 9, 9], BS, None, None, None),
        BlockRemoved([signed64(H0), signed64(HX)], None),
        AllBlocksCleared(),
    ]
    for h in (H0, H1, HX):
        assert -(1 << 63) <= signed64(h) < 1 << 63 and signed64(h) % (1 << 64) == h


def test_payload_is_vllms_event_batch_as_msgpack_maps_tagged_by_type():
    payload = msgpack.unpackb(encode_vllm(KvBatch(7, 1234.5, group_events(RAW, BS))))
    assert payload["ts"] == 1234.5 and payload["data_parallel_rank"] == 0
    stored, _, removed, cleared = payload["events"]
    assert stored == {"type": "BlockStored", "block_hashes": [signed64(H0), signed64(H1)],
                      "parent_block_hash": None, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": BS,
                      "lora_id": None, "medium": None, "lora_name": None}
    assert removed == {"type": "BlockRemoved", "block_hashes": [signed64(H0), signed64(HX)], "medium": None}
    assert cleared == {"type": "AllBlocksCleared"}


def test_hub_publishes_replays_and_feeds_subscribers():
    asyncio.run(_hub_round_trip())


async def _hub_round_trip():
    ctx = zmq.asyncio.Context()
    hub = KvEventHub(BS, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv@pod@model")
    pub_addr = hub._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    replay_addr = hub._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub_addr)
    subscriber = hub.subscribe(0)
    first = asyncio.ensure_future(subscriber.__anext__())
    await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the PUB (slow joiner)
    hub.publish([])  # a step without events sends nothing
    hub.publish(RAW[:3])
    hub.publish(RAW[3:])
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
    assert topic == b"kv@pod@model" and int.from_bytes(seq, "big") == 0
    assert msgpack.unpackb(payload)["events"][0]["block_hashes"] == [signed64(H0), signed64(H1)]
    assert (await asyncio.wait_for(first, 10)).sequence == 0
    assert (await asyncio.wait_for(subscriber.__anext__(), 10)).sequence == 1
    late = hub.subscribe(1)  # a subscriber that asks for the buffered batches from 1 on
    assert [(await late.__anext__()).sequence] == [1]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_addr)
    await dealer.send_multipart((b"", (1).to_bytes(8, "big")))
    _, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10)
    assert int.from_bytes(seq, "big") == 1
    assert msgpack.unpackb(payload)["events"][-1] == {"type": "AllBlocksCleared"}
    _, end, _ = await asyncio.wait_for(dealer.recv_multipart(), 10)
    assert int.from_bytes(end, "big", signed=True) == -1
    await subscriber.aclose()
    await late.aclose()
    for s in (sub, dealer):
        s.close(0)
    hub.close()
    ctx.term()


def test_malformed_replay_requests_are_logged_once_and_replay_serves_on(caplog):
    """Issue 49: the replay socket takes anyone's frames, and each malformed one logged a WARNING."""
    caplog.set_level(logging.WARNING, logger="kvserve")
    assert asyncio.run(_malformed_then_valid()) == -1
    warnings = [r for r in caplog.records if "malformed KV-event replay" in r.getMessage()]
    assert len(warnings) == 1


async def _malformed_then_valid() -> int:
    ctx = zmq.asyncio.Context()
    hub = KvEventHub(BS, None, "tcp://127.0.0.1:0")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(hub._replay.getsockopt(zmq.LAST_ENDPOINT).decode())
    for _ in range(20):
        await dealer.send_multipart((b"", b"not eight bytes"))
    await dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # nothing buffered: just the end
    _, end, _ = await asyncio.wait_for(dealer.recv_multipart(), 10)
    dealer.close(0)
    hub.close()
    ctx.term()
    return int.from_bytes(end, "big", signed=True)


def test_a_grouped_cache_s_events_name_each_block_s_group_and_its_spec():
    """A model with KV cache groups (window 8, then full): the block manager's tuples carry the
    group and its window, and vLLM's events their group_idx and kv_cache_spec fields; a chain
    stored in two groups is one event per group."""
    from kvserve.engine.core.block_manager import BlockManager
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.engine.sequence import Sequence

    bm = BlockManager(16, BS, windows=(8, None))
    bm.kv_events = []
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    bm.admit(seq, bm.match_prefix(seq))
    bm.grow(seq, 9)
    seq.num_computed_tokens = 9
    bm.commit(seq)
    raw = bm.take_kv_events()
    assert raw == [(STORED, H0, None, (1, 2, 3, 4), 0, 8), (STORED, H1, H0, (5, 6, 7, 8), 0, 8),
                   (STORED, H0, None, (1, 2, 3, 4), 1, None), (STORED, H1, H0, (5, 6, 7, 8), 1, None)]
    events = group_events(raw, BS)
    assert [(e.block_hashes, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in events] == [([signed64(H0), signed64(H1)], 0, "sliding_window", 8),
                                 ([signed64(H0), signed64(H1)], 1, "full_attention", None)]
    payload = msgpack.unpackb(encode_vllm(KvBatch(0, 1.0, events)))["events"][0]
    assert payload["group_idx"] == 0 and payload["kv_cache_spec_kind"] == "sliding_window"
    assert payload["kv_cache_spec_sliding_window"] == 8
    removed = group_events([(REMOVED, H0, 1), (REMOVED, H1, 1), (REMOVED, HX, 0)], BS)
    assert removed == [BlockRemoved([signed64(H0), signed64(H1)], None, 1),
                       BlockRemoved([signed64(HX)], None, 0)]
