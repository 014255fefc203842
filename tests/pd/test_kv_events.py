"""KV events: what the device pool indexes and drops, logged with tokens and parents, and the
wire format a vLLM subscriber decodes (its structs, written out here from its documentation)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from deepinfer.cache_layout import CacheGroup, plan_cache_layout
from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.transport.kv_event_log import DEVICE, KVEventLog, Removed, Stored
from deepinfer.transport.kv_events import KVEventPublisher
from tests.engine.helpers import TENSOR, request, run_step


def _scheduler(num_blocks: int, log: KVEventLog) -> Scheduler:
    layout = plan_cache_layout([CacheGroup("full", (TENSOR,))], 4, num_blocks=num_blocks)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=2048), 8192, KVCacheManager(layout, True, log))


def test_indexed_blocks_are_logged_with_their_tokens_and_parent() -> None:
    log = KVEventLog()
    scheduler = _scheduler(16, log)
    scheduler.add_request(request(list(range(10)), max_tokens=1), b"root")
    run_step(scheduler)
    events = log.drain()
    assert len(events) == 1 and isinstance(events[0], Stored)
    stored = events[0]
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == DEVICE
    assert stored.parent_block_hash is None and len(stored.block_hashes) == 2
    assert log.drain() == []


def test_evicted_blocks_are_logged_as_removed() -> None:
    log = KVEventLog()
    scheduler = _scheduler(3, log)
    scheduler.add_request(request(list(range(9)), max_tokens=1), b"root")  # two full blocks cached
    run_step(scheduler)
    first = log.drain()[0]
    scheduler.add_request(request(list(range(100, 109)), max_tokens=1), b"root")
    run_step(scheduler)
    removed = [e for e in log.drain() if isinstance(e, Removed)]
    assert {h for e in removed for h in e.block_hashes} <= set(first.block_hashes)
    assert removed


def test_reset_logs_all_cleared() -> None:
    log = KVEventLog()
    scheduler = _scheduler(8, log)
    scheduler.add_request(request(list(range(9)), max_tokens=1), b"root")
    run_step(scheduler)
    log.drain()
    assert scheduler.kv.reset_prefix_cache()
    assert [type(e).__name__ for e in log.drain()] == ["Cleared"]


# vLLM's wire structs (vllm/distributed/kv_events.py), as its subscriber example declares them.
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


class _KVEventBatch(_EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_a_vllm_subscriber_decodes_our_batches() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    try:
        deadline = time.monotonic() + 10
        received = None
        while received is None and time.monotonic() < deadline:  # PUB/SUB: the first sends may be lost
            publisher.publish([Stored([h1, h2], None, list(range(8)), 4, DEVICE), Removed([h1], DEVICE)])
            if sub.poll(100):
                received = sub.recv_multipart()
        assert received is not None
        topic, sequence_bytes, payload = received
        assert topic == b"" and len(sequence_bytes) == 8
        batch = msgspec.msgpack.Decoder(_KVEventBatch).decode(payload)
        stored, removed = batch.events
        assert isinstance(stored, BlockStored) and stored.block_hashes == [h1, h2]
        assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "GPU"
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [h1]
    finally:
        sub.close(0)
        context.term()
        publisher.close()
