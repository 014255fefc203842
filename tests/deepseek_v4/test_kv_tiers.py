"""DeepSeek-V4's hybrid cache on the KV tiers beyond the device: a real file store reopened by a
new engine (a restart), the host tier after device eviction, the prefill/decode handoff through
the store and directly (chunks pulled over TCP), and namespaces that keep another model's chunks
(Llama, DeepSeek-V3's MLA) from ever matching a V4 one.

Chunks of 2 blocks (8 tokens, the lcm of the groups' blocks) under a 16-token window: a chunk's
sliding part reaches into the chunk before it, and chunk boundaries fall inside the window and
inside HCA windows.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cache_layout import CacheGroup, CacheTensor, plan_cache_layout
from deepinfer.engine.connectors.chunks import ChunkLayout
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.outputs import KVHandoff
from deepinfer.sequence import EngineRequest, KVSource, Sequence
from deepinfer.store import TieredKVStore
from deepinfer.store.file_backend import FileBackend
from tests.deepseek_v4.test_engine import BLOCK, _blocks_in_use, _greedy, _llm, _prompts

CHUNK_BLOCKS = 2
CHUNK_TOKENS = CHUNK_BLOCKS * BLOCK


@pytest.fixture(scope="module")
def cases(checkpoint):
    """A 70-token prompt, variants sharing 24 and 44 of its tokens, and their greedy output
    with no caching at all (one engine, reused as the weights of the others)."""
    (base,) = _prompts(checkpoint, [70], seed=31)
    tails = _prompts(checkpoint, [6, 9], seed=32)
    prompts = [base, base[:24] + tails[0], base[:44] + tails[1]]
    off = _llm(checkpoint, enable_prefix_caching=False)
    return off, prompts, _greedy(off, prompts, max_tokens=12)


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


def test_greedy_output_identical_after_a_restart_from_the_file_store(checkpoint, cases, tmp_path):
    off, prompts, expected = cases
    store = str(tmp_path / "kv")
    first = _tiered_llm(off, kv_store=store)
    assert _greedy(first, prompts[:1], max_tokens=12) == expected[:1]
    saved = first.engine.core.connector.metrics()["engine_chunks_saved"]
    assert _blocks_in_use(first) == 0
    first.close()  # flushes the write-behind queue
    assert saved >= 70 // CHUNK_TOKENS

    second = _tiered_llm(off, kv_store=store)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, shared, want in zip(prompts, [70, 24, 44], expected):
        second.reset_prefix_cache()  # every hit below comes from the store, none from the device
        (out,) = second.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == want
        assert out.num_cached_tokens == _stored_hits(prompt, shared)
    metrics = second.engine.core.connector.metrics()
    assert metrics["store_hits"] >= 3 and metrics["corrupt_objects"] == metrics["foreign_objects"] == 0
    assert _blocks_in_use(second) == 0
    second.close()


def test_host_tier_restores_a_prefix_after_device_eviction(checkpoint, cases):
    off, prompts, expected = cases
    llm = _tiered_llm(off, num_blocks=48, kv_host_cache_bytes=64 << 20)
    assert _greedy(llm, prompts[:1], max_tokens=12) == expected[:1]
    # Other prompts push every block of the first out of the device cache (192 tokens of room).
    for other in _prompts(checkpoint, [150, 150], seed=33):
        _greedy(llm, [other], max_tokens=2)
    core = llm.engine.core
    assert core.kv.find_cached_prefix(_sequence_of(core, prompts[2])).num_tokens == 0
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected[2]
    assert out.num_cached_tokens == _stored_hits(prompts[2], 44)
    assert core.connector.metrics()["host_hits"] >= 1
    assert _blocks_in_use(llm) == 0
    llm.close()


def test_pd_handoff_through_the_store_carries_every_group(checkpoint, cases, tmp_path):
    """A prefill engine hands a prompt off through the store; a decode engine on the same store
    starts from its chunks (the hybrid cache's groups, all of them) and decodes the same tokens."""
    off, prompts, expected = cases
    options = dict(kv_store=str(tmp_path / "kv"), kv_transfer="store")
    prefill = _tiered_llm(off, role="prefill", **options)
    core = prefill.engine.core
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.add_request(EngineRequest("handoff", prompts[0], once, kv_handoff="t1"))
    handoffs = []
    deadline = time.monotonic() + 30
    while not handoffs and time.monotonic() < deadline:
        core.step() if core.has_work() else core.housekeeping()
        handoffs += core.take_handoffs()
    assert [(h.transfer_id, h.error, h.num_tokens) for h in handoffs] == [("t1", None, 64)]
    assert _blocks_in_use(prefill) == 0
    prefill.close()

    decode = _tiered_llm(off, role="decode", **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = decode.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected[0]
    assert out.num_cached_tokens == 64
    assert _blocks_in_use(decode) == 0
    decode.close()


DIRECT_CHUNK_BLOCKS = 4  # 16 tokens (two hit lengths of 8): a decoder's hit of 24 ends inside a chunk


def _direct_llm(off: LLM, role: str, **options) -> LLM:
    """An engine on the shared weights in a direct handoff (chunks of DIRECT_CHUNK_BLOCKS)."""
    options.setdefault("kv_chunk_blocks", DIRECT_CHUNK_BLOCKS)
    return LLM(
        loaded=off.engine.core.loaded, block_size=BLOCK, num_threads=1, num_blocks=256, role=role, **options
    )


def _hand_off(prefill: LLM, transfer_id: str, prompt: list[int]) -> KVHandoff:
    """What the router asks of the prefill engine: one token of `prompt`, then its KV leased."""
    core = prefill.engine.core
    once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    core.add_request(EngineRequest(transfer_id, prompt, once, kv_handoff=transfer_id))
    handoffs: list[KVHandoff] = []
    deadline = time.monotonic() + 30
    while not handoffs and time.monotonic() < deadline:
        core.step() if core.has_work() else core.housekeeping()
        handoffs += core.take_handoffs()
    (handoff,) = handoffs
    return handoff


def _decode(
    decode: LLM, request_id: str, prompt: list[int], source: KVSource | None
) -> tuple[list[int], int, str | None]:
    """Greedy tokens, cached prompt tokens and error of one request on the decode engine."""
    core = decode.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    core.add_request(EngineRequest(request_id, prompt, params, kv_source=source))
    tokens: list[int] = []
    cached, error = 0, None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in core.step() if core.has_work() else core.housekeeping():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
            error = out.error or error
            if out.finish_reason is not None:
                return tokens, cached, error
    raise AssertionError(f"{request_id} did not finish")


def _direct_hits(prompt: list[int]) -> int:
    """Tokens a direct handoff covers: up to the last hit length (8) before the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK // 8 * 8


def _leases(prefill: LLM) -> int:
    core = prefill.engine.core
    core.housekeeping()
    return core.connector.metrics()["pd_leases"]


def test_direct_pd_handoff_carries_every_group(checkpoint, cases):
    """Prompts shorter than a chunk, of one chunk and a piece, of several chunks, and one the
    decoder already holds 24 tokens of (inside its second chunk): the decoder pulls the chunks
    it lacks over TCP and decodes what one engine decodes; no block stays in use on either."""
    off, (base, partial, _), expected = cases
    short = _prompts(checkpoint, [7, 13, 27], seed=34)
    prompts = [*short, base]
    want = _greedy(off, short, max_tokens=12) + expected[:1]
    prefill = _direct_llm(off, "prefill")
    decode = _direct_llm(off, "decode")
    address = prefill.engine.core.kv_transfer_address
    for i, (prompt, tokens) in enumerate(zip(prompts[:3], want)):
        handoff = _hand_off(prefill, f"t{i}", prompt)
        assert (handoff.error, handoff.num_tokens) == (None, _direct_hits(prompt))  # 0, 8, 24
        assert _blocks_in_use(prefill) == 0  # the chunks wait in host memory
        assert _decode(decode, f"r{i}", prompt, KVSource(address, f"t{i}")) == (
            tokens,
            _direct_hits(prompt),
            None,
        )
        assert _leases(prefill) == 0 and _blocks_in_use(decode) == 0

    # The decoder holds the first 24 tokens of `base`; the prefiller none (reset).
    decode.reset_prefix_cache()
    prefill.reset_prefix_cache()
    assert _decode(decode, "local", partial, None)[0] == expected[1]
    core = decode.engine.core
    assert core.kv.find_cached_prefix(_sequence_of(core, base)).num_tokens == 24
    received = core.connector.metrics()["pd_blocks_received"]
    handoff = _hand_off(prefill, "t-base", base)
    assert (handoff.error, handoff.num_tokens) == (None, 64)
    assert _decode(decode, "r-base", base, KVSource(address, "t-base")) == (want[3], 64, None)
    layout = ChunkLayout(core.kv.groups, BLOCK, DIRECT_CHUNK_BLOCKS)
    every = sum(len(p.block_indices) for c, end in layout.pieces(64) for p in layout.parts(c, end))
    assert 0 < core.connector.metrics()["pd_blocks_received"] - received < every  # chunks 1.. only
    assert _leases(prefill) == 0 and _blocks_in_use(prefill) == _blocks_in_use(decode) == 0
    prefill.close()
    decode.close()


def test_direct_pd_handoff_failures_recompute_or_fail(checkpoint, cases):
    """A lease that ended before the decoder came, a decoder of other chunks and a prefiller
    that is gone: the decoder recomputes (greedy output unchanged) or, with
    kv_transfer_failure='fail', fails the request; no block stays in use on either engine."""
    off, (base, _, _), expected = cases
    prefill = _direct_llm(off, "prefill", kv_transfer_lease=0.3)
    decode = _direct_llm(off, "decode")
    strict = _direct_llm(off, "decode", kv_transfer_failure="fail")
    address = prefill.engine.core.kv_transfer_address
    assert _hand_off(prefill, "late", base).num_tokens == 64
    time.sleep(0.4)
    assert _leases(prefill) == 0 and prefill.engine.core.connector.metrics()["pd_leases_expired"] == 1
    assert _decode(decode, "r-late", base, KVSource(address, "late")) == (expected[0], 0, None)
    assert _decode(strict, "s-late", base, KVSource(address, "late"))[2] is not None

    other = _direct_llm(off, "decode", kv_chunk_blocks=2)
    assert _hand_off(prefill, "other", base).num_tokens == 64
    assert _decode(other, "o-other", base, KVSource(address, "other")) == (expected[0], 0, None)
    assert other.engine.core.connector.metrics()["pd_pulls_failed"] == 1
    assert _leases(prefill) == 0 and _blocks_in_use(other) == 0  # the refused lease ended
    other.close()

    assert _hand_off(prefill, "gone", base).num_tokens == 64
    prefill.close()  # the listener closes with the engine
    decode.reset_prefix_cache()
    assert _decode(decode, "r-gone", base, KVSource(address, "gone")) == (expected[0], 0, None)
    _, _, error = _decode(strict, "s-gone", base, KVSource(address, "gone"))
    assert "did not arrive from the prefill engine" in error
    assert decode.engine.core.connector.metrics()["pd_pulls_failed"] == 2
    assert _blocks_in_use(prefill) == _blocks_in_use(decode) == _blocks_in_use(strict) == 0
    decode.close()
    strict.close()


def _sequence_of(core, prompt: list[int]) -> Sequence:
    root = namespace_root(core.fingerprint)
    return Sequence(-1, EngineRequest("probe", prompt, SamplingParams()), 0, list(prompt), len(prompt), root)


def _chunk_layout(groups: list[CacheGroup]) -> ChunkLayout:
    layout = plan_cache_layout(groups, BLOCK, num_blocks=64)
    kv = KVCacheManager(layout)
    return ChunkLayout(kv.groups, BLOCK, CHUNK_BLOCKS)


def _tensor(name: str, width: int) -> CacheTensor:
    return CacheTensor(name, (width,), "float32", 4)


LLAMA = [CacheGroup("full", (_tensor("k", 64), _tensor("v", 64)))]
V3_MLA = [CacheGroup("full", (_tensor("latent", 72),))]


def test_a_v3_or_llama_namespace_never_matches_a_v4_one(checkpoint, tmp_path):
    """Even under one prefix root (the same tokens, weights and salt), chunks of other cache
    groups live in another namespace: a V4 engine reading them sees foreign objects, never KV."""
    v4 = _llm(checkpoint, num_blocks=32, kv_chunk_blocks=CHUNK_BLOCKS, kv_host_cache_bytes=1 << 20)
    v4_chunks = v4.engine.core.connector.chunks
    root = namespace_root("same-weights")
    names = {
        "v4": v4_chunks.store_namespace(root),
        "llama": _chunk_layout(LLAMA).store_namespace(root),
        "v3": _chunk_layout(V3_MLA).store_namespace(root),
        "v4 with other chunks": ChunkLayout(v4.engine.core.kv.groups, BLOCK, 4).store_namespace(root),
    }
    assert len(set(names.values())) == len(names)
    key = b"k" * 32
    with TieredKVStore(backend=FileBackend(str(tmp_path / "kv"))) as store:
        for name in ("llama", "v3"):
            assert store.save(key, names[name], np.zeros(64, np.uint8), num_tokens=8, traffic_class="chat")
        assert store.flush(timeout=10)
        assert store.load([key], names["v4"]).result() == []
        assert store.metrics_snapshot()["foreign_objects"] >= 1
    v4.close()


def test_a_chunk_keeps_the_last_window_and_its_own_compressed_entries(checkpoint):
    """Chunk 2 (tokens 16..23): the raw KV of positions 9..23 (window 16), the compressor and
    indexer rows of 17..23 (window 8), and only the chunk's own CSA (4-token) and HCA (8-token)
    blocks."""
    llm = _llm(checkpoint, num_blocks=32, kv_chunk_blocks=CHUNK_BLOCKS, kv_host_cache_bytes=1 << 20)
    parts = llm.engine.core.connector.chunks.parts(2)
    assert [(p.group, p.block_indices) for p in parts] == [
        (0, range(2, 6)),
        (1, range(4, 6)),
        (2, range(4, 6)),
        (3, range(2, 3)),
    ]
    groups = llm.engine.core.layout.groups
    assert [p.block_bytes for p in parts] == [g.block_bytes for g in groups]
    llm.close()


def test_the_direct_handoff_cuts_the_tail_at_the_last_hit_length(checkpoint):
    """Chunks of 16 tokens, hits on multiples of 8: 28 usable tokens go as chunk 0 and the piece
    of chunk 1 up to token 24, which keeps what a whole chunk ending there would."""
    llm = _llm(checkpoint, num_blocks=32, role="decode", kv_chunk_blocks=DIRECT_CHUNK_BLOCKS)
    chunks = llm.engine.core.connector.chunks
    assert chunks.pieces(7) == [] and chunks.pieces(12) == [(0, 8)]
    assert chunks.pieces(28) == [(0, 16), (1, 24)]
    assert chunks.pieces(64) == [(0, 16), (1, 32), (2, 48), (3, 64)]
    assert [(p.group, p.block_indices) for p in chunks.parts(1, 24)] == [
        (0, range(2, 6)),  # the raw KV of positions 9..23 (window 16)
        (1, range(4, 6)),  # the compressor and indexer rows of 17..23 (window 8)
        (2, range(4, 6)),  # the piece's own CSA blocks
        (3, range(2, 3)),  # and HCA block
    ]
    llm.close()


def test_a_chunk_must_end_on_every_groups_block(checkpoint):
    """One block of 4 tokens cannot be a chunk: the HCA group's blocks cover 8."""
    with pytest.raises(ValueError, match=r"kv_chunk_blocks: .* 8 tokens"):
        _llm(checkpoint, num_blocks=32, kv_chunk_blocks=1, kv_host_cache_bytes=1 << 20)
