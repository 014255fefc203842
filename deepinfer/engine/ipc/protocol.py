"""Messages between the API process and the engine process (msgpack via msgspec).

API -> engine: AddRequest, AbortRequest, ResetPrefixCache, Shutdown.
A request travels as a WireRequest: EngineRequest's fields with their types resolvable at run
time (EngineRequest itself names some types for type checkers only), one for one.
Engine -> API: EngineReady once, then EngineOutputs per step (new tokens of every sequence that
advanced, plus the engine's stats), and EngineFailed if the loop crashes.
Token ids only: text never crosses this boundary.
"""

from __future__ import annotations

import msgspec

from deepinfer.engine.outputs import KVHandoff, SequenceOutput
from deepinfer.engine.stats import EngineStats
from deepinfer.image_input import ImageInput
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, KVSource
from deepinfer.structured.spec import GrammarSpec


class WireRequest(msgspec.Struct, array_like=True):
    """EngineRequest on the wire (a test keeps the two field lists identical)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int
    cache_salt: str | None
    traffic_class: str | None
    grammar: GrammarSpec | None
    kv_handoff: str | None
    kv_source: KVSource | None
    images: list[ImageInput]

    @classmethod
    def of(cls, request: EngineRequest) -> WireRequest:
        return cls(**{name: getattr(request, name) for name in cls.__struct_fields__})

    def to_request(self) -> EngineRequest:
        return EngineRequest(**{name: getattr(self, name) for name in self.__struct_fields__})


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: WireRequest


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    index: int | None = None  # None: every sequence of the request


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Stop after flushing queued KV-store writes for at most `flush_timeout_s`."""

    flush_timeout_s: float = 30.0


EngineInput = AddRequest | AbortRequest | ResetPrefixCache | Shutdown


class EngineInfo(msgspec.Struct, array_like=True):
    """What the API side (and a router) must know to check requests before they reach the
    engine: the model, its limits, the traffic classes the KV store keeps, and the fingerprint
    that roots every prefix hash (with the block size, enough to compute them elsewhere); for a
    router also the engine's role, where it publishes KV events and serves KV transfers, and
    which shared store it reads (a chunk stored there is a hit for every engine reading it)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    fingerprint: str
    traffic_classes: list[str]
    max_num_seqs: int
    max_num_batched_tokens: int
    role: str = "both"
    kv_transfer: str = "direct"
    kv_transfer_failure: str = "recompute"
    kv_transfer_address: str | None = None  # host:port of a prefill engine's transfer listener
    kv_events_endpoint: str | None = None
    kv_store: str | None = None  # the shared store's identity (a path or redis host/db), no secrets
    kv_chunk_blocks: int = 0  # blocks per KV chunk stored or handed off (0: this engine cuts none)
    kv_transfer_layout: str | None = None  # the chunks a direct handoff moves (prefill/decode roles)
    accepts_images: bool = False  # the model has a vision tower: requests may carry images


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    info: EngineInfo


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[SequenceOutput]
    stats: EngineStats
    prefix_cache_reset: bool | None = None  # the answer to a ResetPrefixCache, when there was one
    handoffs: list[KVHandoff] = []  # prefill role: prompts whose KV is ready for their decoder


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


EngineMessage = EngineReady | EngineOutputs | EngineFailed


class Codec:
    """One encoder and the two decoders, reused for every message (msgspec's fast path)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._inputs = msgspec.msgpack.Decoder(EngineInput)
        self._messages = msgspec.msgpack.Decoder(EngineMessage)

    def encode(self, message: EngineInput | EngineMessage) -> bytes:
        return self._encoder.encode(message)

    def decode_input(self, data: bytes | memoryview) -> EngineInput:
        return self._inputs.decode(data)

    def decode_message(self, data: bytes | memoryview) -> EngineMessage:
        return self._messages.decode(data)
