"""KV events on the wire, in vLLM's format, so existing routers (and ours) can consume them.

A ZMQ PUB socket sends one multipart message per engine step that changed a prefix cache:
`[topic, sequence number (8 bytes, big-endian), payload]`, the payload a msgpack `KVEventBatch`
`[timestamp, [event, ...]]` whose events are tagged arrays: `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]`, `["BlockRemoved", block_hashes,
medium]`, `["AllBlocksCleared"]`. Our block hashes are the 32-byte chained SHA-256 prefix hashes
(bytes), which vLLM's decoders accept (its ExternalBlockHash is bytes or int). A subscriber
that sees a gap in the sequence numbers has lost events (PUB drops when a subscriber lags);
there is no replay socket, so it should forget what it knew of this engine.

With a cluster key the PUB socket is a CURVE server (security/curve.py): only a subscriber
holding the key-derived client key completes the handshake, and the events are encrypted; the
messages inside are unchanged. `token_ids=False` publishes empty token id lists (a consumer that
matches by block hash needs no more, and the events then carry no prompt text).
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from deepinfer.security.curve import client_keys, server_keys
from deepinfer.transport.kv_event_log import Cleared, KVEvent, Removed, Stored

log = logging.getLogger(__name__)

DEFAULT_TOPIC = b""  # vLLM's default: subscribers of "" receive every topic


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The tagged base of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


def to_wire(event: KVEvent, token_ids: bool = True) -> WireEvent:
    if isinstance(event, Stored):
        tokens = event.token_ids if token_ids else []
        return BlockStored(
            event.block_hashes, event.parent_block_hash, tokens, event.block_size, None, event.medium
        )
    if isinstance(event, Removed):
        return BlockRemoved(event.block_hashes, event.medium)
    assert isinstance(event, Cleared)
    return AllBlocksCleared()


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    return _DECODER.decode(payload)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventPublisher:
    """The engine's PUB socket. `publish` never blocks: a slow subscriber loses messages (and
    sees the gap in the sequence numbers), the engine never waits for one. `key`: the cluster
    key (CURVE, subscribers must hold it); `token_ids`: whether stored blocks name their tokens."""

    def __init__(
        self,
        endpoint: str,
        topic: bytes = DEFAULT_TOPIC,
        context: zmq.Context | None = None,
        *,
        key: bytes | None = None,
        token_ids: bool = True,
    ) -> None:
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        if key is not None:
            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", _ClusterPeers(client_keys(key)[0]))
            self._socket.curve_secretkey = server_keys(key)[1]
            self._socket.curve_server = True
        self._token_ids = token_ids
        self._socket.bind(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0
        self.num_published = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=[to_wire(e, self._token_ids) for e in events])
        frames = [self._topic, self._sequence.to_bytes(8, "big"), self._encoder.encode(batch)]
        self._sequence += 1
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.debug("KV events dropped: the publisher's queue is full")
        self.num_published += len(events)

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._own_context:
            self._context.term()


class _ClusterPeers:
    """The ZAP check: a subscriber's CURVE key must be the one derived from the cluster key."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._public)
