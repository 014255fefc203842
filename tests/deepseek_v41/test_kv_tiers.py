"""DeepSeek-V4.1's paged hybrid cache on the KV tiers beyond the device, as tests/deepseek_v4/
test_kv_tiers.py does for V4: a real file store reopened by a new engine (a restart), the host
tier after device eviction, the prefill/decode handoff through the store and directly (chunks
pulled over TCP), and namespaces that keep a DeepSeek-V4 cache's chunks from ever matching a
V4.1 one.

The tiny V4.1 (test_engine.py) has an 8-token window, blocks of 4 tokens and five groups: the
raw KV window, the C2 compressor-state rows (window 2), the C2 entries with their index keys,
the C1 entries with theirs, and Engram's token-id rows (int64, window 3). Chunks of 2 blocks (8
tokens): the window of a chunk's end reaches into the chunk before it, and a C2 entry's pair of
tokens never straddles a chunk boundary.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cache_layout import plan_cache_layout
from deepinfer.engine.connectors.chunks import ChunkLayout
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.outputs import KVHandoff
from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.model import cache_declarations as v4_declarations
from deepinfer.model.deepseek_v4.model import v4_cache_groups
from deepinfer.sequence import EngineRequest, KVSource, Sequence
from deepinfer.store import TieredKVStore
from deepinfer.store.file_backend import FileBackend
from tests.deepseek_v4.tiny_v4 import tiny_config as v4_tiny_config
from tests.deepseek_v41.test_engine import BLOCK, _blocks_in_use, _greedy, _llm, _prompts, checkpoint  # noqa: F401

CHUNK_BLOCKS = 2
CHUNK_TOKENS = CHUNK_BLOCKS * BLOCK
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cases(checkpoint):  # noqa: F811
    """A 70-token prompt, variants sharing 24 and 44 of its tokens, and their greedy output
    with no caching at all (one engine, reused as the weights of the others)."""
    (base,) = _prompts(checkpoint, [70], seed=31)
    tails = _prompts(checkpoint, [6, 9], seed=32)
    prompts = [base, base[:24] + tails[0], base[:44] + tails[1]]
    off = _llm(checkpoint, enable_prefix_caching=False)
    return off, prompts, _greedy(off, prompts, max_tokens=MAX_TOKENS)


def _stored_hits(prompt: list[int], shared: int) -> int:
    """Tokens a store hit covers: whole chunks of the shared prefix, the last token left to compute."""
    return min(shared, len(prompt) - 1) // CHUNK_TOKENS * CHUNK_TOKENS


def _tiered_llm(off: LLM, num_blocks: int = 256, **options) -> LLM:
    """An engine on the shared weights with stored chunks of CHUNK_BLOCKS, its KV tiers (and role)
    given by `options`."""
    return LLM(
        loaded=off.engine.core.loaded,
        block_size=BLOCK,
        num_threads=1,
        num_blocks=num_blocks,
        kv_chunk_blocks=CHUNK_BLOCKS,
        **options,
    )


def _generate(llm: LLM, prompt: list[int]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def test_greedy_output_identical_after_a_restart_from_the_file_store(checkpoint, cases, tmp_path):  # noqa: F811
    off, prompts, expected = cases
    store = str(tmp_path / "kv")
    first = _tiered_llm(off, kv_store=store)
    assert _greedy(first, prompts[:1], max_tokens=MAX_TOKENS) == expected[:1]
    saved = first.engine.core.connector.metrics()["engine_chunks_saved"]
    assert _blocks_in_use(first) == 0
    first.close()  # flushes the write-behind queue
    assert saved >= 70 // CHUNK_TOKENS

    second = _tiered_llm(off, kv_store=store)
    for prompt, shared, want in zip(prompts, [70, 24, 44], expected):
        second.reset_prefix_cache()  # every hit below comes from the store, none from the device
        out = _generate(second, prompt)
        assert list(out.outputs[0].token_ids) == want
        assert out.num_cached_tokens == _stored_hits(prompt, shared)
    metrics = second.engine.core.connector.metrics()
    assert metrics["store_hits"] >= 3 and metrics["corrupt_objects"] == metrics["foreign_objects"] == 0
    assert _blocks_in_use(second) == 0
    second.close()


def test_host_tier_restores_a_prefix_after_device_eviction(checkpoint, cases):  # noqa: F811
    off, prompts, expected = cases
    llm = _tiered_llm(off, num_blocks=48, kv_host_cache_bytes=64 << 20)
    assert _greedy(llm, prompts[:1], max_tokens=MAX_TOKENS) == expected[:1]
    # Other prompts push every block of the first out of the device cache (192 tokens of room).
    for other in _prompts(checkpoint, [150, 150], seed=33):
        _greedy(llm, [other], max_tokens=2)
    core = llm.engine.core
    assert core.kv.find_cached_prefix(_sequence_of(core, prompts[2])).num_tokens == 0
    out = _generate(llm, prompts[2])
    assert list(out.outputs[0].token_ids) == expected[2]
    assert out.num_cached_tokens == _stored_hits(prompts[2], 44)
    assert core.connector.metrics()["host_hits"] >= 1
    assert _blocks_in_use(llm) == 0
    llm.close()


def _run_until_handoff(core, transfer_id: str, prompt: list[int]) -> list[KVHandoff]:
    """What the router asks of a prefill engine: one token of `prompt`, then its KV handed off."""
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.add_request(EngineRequest(transfer_id, prompt, once, kv_handoff=transfer_id))
    handoffs: list[KVHandoff] = []
    deadline = time.monotonic() + 30
    while not handoffs and time.monotonic() < deadline:
        core.step() if core.has_work() else core.housekeeping()
        handoffs += core.take_handoffs()
    return handoffs


def test_pd_handoff_through_the_store_carries_every_group(checkpoint, cases, tmp_path):  # noqa: F811
    """A prefill engine hands a prompt off through the store; a decode engine on the same store
    starts from its chunks (all five groups, the C2 state and token ids included) and decodes
    the same tokens."""
    off, prompts, expected = cases
    options = dict(kv_store=str(tmp_path / "kv"), kv_transfer="store")
    prefill = _tiered_llm(off, role="prefill", **options)
    handoffs = _run_until_handoff(prefill.engine.core, "t1", prompts[0])
    assert [(h.transfer_id, h.error, h.num_tokens) for h in handoffs] == [("t1", None, 64)]
    assert _blocks_in_use(prefill) == 0
    prefill.close()

    decode = _tiered_llm(off, role="decode", **options)
    out = _generate(decode, prompts[0])
    assert list(out.outputs[0].token_ids) == expected[0]
    assert out.num_cached_tokens == 64
    assert _blocks_in_use(decode) == 0
    decode.close()


DIRECT_CHUNK_BLOCKS = 4  # 16 tokens (four hit lengths of 4): a decoder's hit of 24 ends inside a chunk


def _direct_llm(off: LLM, role: str) -> LLM:
    return LLM(
        loaded=off.engine.core.loaded,
        block_size=BLOCK,
        num_threads=1,
        num_blocks=256,
        role=role,
        kv_chunk_blocks=DIRECT_CHUNK_BLOCKS,
    )


def _decode(
    decode: LLM, request_id: str, prompt: list[int], source: KVSource | None
) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request on the decode engine (no error)."""
    core = decode.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core.add_request(EngineRequest(request_id, prompt, params, kv_source=source))
    tokens: list[int] = []
    cached = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in core.step() if core.has_work() else core.housekeeping():
            assert out.error is None, out.error
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
            if out.finish_reason is not None:
                return tokens, cached
    raise AssertionError(f"{request_id} did not finish")


def _direct_hits(prompt: list[int]) -> int:
    """Tokens a direct handoff covers: up to the last hit length (a block) before the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_direct_pd_handoff_carries_every_group(checkpoint, cases):  # noqa: F811
    """Prompts shorter than a chunk, of one chunk and a piece, of several chunks, and one the
    decoder already holds 24 tokens of (inside its second chunk): the decoder pulls the chunks it
    lacks over TCP and decodes what one engine decodes; no block stays in use on either."""
    off, (base, partial, _), expected = cases
    short = _prompts(checkpoint, [3, 13, 27], seed=34)
    want = _greedy(off, short, max_tokens=MAX_TOKENS)
    prefill = _direct_llm(off, "prefill")
    decode = _direct_llm(off, "decode")
    address = prefill.engine.core.kv_transfer_address
    for i, (prompt, tokens) in enumerate(zip(short, want)):
        (handoff,) = _run_until_handoff(prefill.engine.core, f"t{i}", prompt)
        assert (handoff.error, handoff.num_tokens) == (None, _direct_hits(prompt))  # 0, 12, 24
        assert _blocks_in_use(prefill) == 0  # the chunks wait in host memory
        assert _decode(decode, f"r{i}", prompt, KVSource(address, f"t{i}")) == (tokens, _direct_hits(prompt))
        assert _blocks_in_use(decode) == 0

    # The decoder holds the first 24 tokens of `base`; the prefiller none (reset).
    decode.reset_prefix_cache()
    prefill.reset_prefix_cache()
    assert _decode(decode, "local", partial, None)[0] == expected[1]
    core = decode.engine.core
    assert core.kv.find_cached_prefix(_sequence_of(core, base)).num_tokens == 24
    received = core.connector.metrics()["pd_blocks_received"]
    (handoff,) = _run_until_handoff(prefill.engine.core, "t-base", base)
    assert (handoff.error, handoff.num_tokens) == (None, 68)
    assert _decode(decode, "r-base", base, KVSource(address, "t-base")) == (expected[0], 68)
    layout = core.connector.chunks
    every = sum(len(p.block_indices) for c, end in layout.pieces(68) for p in layout.parts(c, end))
    assert 0 < core.connector.metrics()["pd_blocks_received"] - received < every  # chunks 1.. only
    assert _blocks_in_use(prefill) == _blocks_in_use(decode) == 0
    prefill.close()
    decode.close()


def _sequence_of(core, prompt: list[int]) -> Sequence:
    root = namespace_root(core.fingerprint)
    return Sequence(-1, EngineRequest("probe", prompt, SamplingParams()), 0, list(prompt), len(prompt), root)


def _v4_chunk_layout() -> ChunkLayout:
    """The chunk layout of a tiny DeepSeek-V4 (sliding, CSA, HCA) at the same block and chunk size."""
    arch = DeepseekV4Arch.from_raw(v4_tiny_config(64, sliding_window=8))
    groups = v4_cache_groups(v4_declarations(arch), torch.float32, "target")
    kv = KVCacheManager(plan_cache_layout(groups, BLOCK, num_blocks=64))
    return ChunkLayout(kv.groups, BLOCK, CHUNK_BLOCKS)


def test_a_v4_namespace_never_matches_a_v41_one(checkpoint, tmp_path):  # noqa: F811
    """Under one prefix root (the same tokens, weights and salt), a V4 cache's chunks live in
    another namespace: a V4.1 engine reading them sees foreign objects, never KV."""
    v41 = _llm(checkpoint, num_blocks=32, kv_chunk_blocks=CHUNK_BLOCKS, kv_host_cache_bytes=1 << 20)
    root = namespace_root("same-weights")
    names = {
        "v41": v41.engine.core.connector.chunks.store_namespace(root),
        "v4": _v4_chunk_layout().store_namespace(root),
        "v41 with other chunks": ChunkLayout(v41.engine.core.kv.groups, BLOCK, 4).store_namespace(root),
    }
    assert len(set(names.values())) == len(names)
    key = b"k" * 32
    with TieredKVStore(backend=FileBackend(str(tmp_path / "kv"))) as store:
        assert store.save(key, names["v4"], np.zeros(64, np.uint8), num_tokens=8, traffic_class="chat")
        assert store.flush(timeout=10)
        assert store.load([key], names["v41"]).result() == []
        assert store.metrics_snapshot()["foreign_objects"] >= 1
    v41.close()


def test_a_chunk_keeps_each_groups_window_and_its_own_entries(checkpoint):  # noqa: F811
    """Chunk 2 (tokens 16..23): the raw KV of positions 17..23 (window 8), the C2 state of 23
    (window 2), the chunk's own C2 and C1 blocks, and the token ids of 22..23 (window 3); the
    payload is every group's block bytes, the int64 token-id rows included."""
    llm = _llm(checkpoint, num_blocks=32, kv_chunk_blocks=CHUNK_BLOCKS, kv_host_cache_bytes=1 << 20)
    parts = llm.engine.core.connector.chunks.parts(2)
    assert [(p.group, p.block_indices) for p in parts] == [
        (0, range(4, 6)),
        (1, range(5, 6)),
        (2, range(4, 6)),
        (3, range(4, 6)),
        (4, range(5, 6)),
    ]
    groups = llm.engine.core.layout.groups
    assert [p.block_bytes for p in parts] == [g.block_bytes for g in groups]
    assert parts[4].block_bytes == BLOCK * 8  # a block of token ids: 4 int64
    llm.close()
