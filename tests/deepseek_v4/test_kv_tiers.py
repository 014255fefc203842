"""DeepSeek-V4's hybrid cache on the KV tiers beyond the device: a real file store reopened by a
new engine (a restart), the host tier after device eviction, and namespaces that keep another
model's chunks (Llama, DeepSeek-V3's MLA) from ever matching a V4 one.

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
from deepinfer.engine.kv_cache.manager import KVCacheManager
from deepinfer.engine.kv_cache.prefix import namespace_root
from deepinfer.engine.kv_chunks import ChunkLayout
from deepinfer.sequence import EngineRequest, Sequence
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


def test_a_chunk_must_end_on_every_groups_block(checkpoint):
    """One block of 4 tokens cannot be a chunk: the HCA group's blocks cover 8."""
    with pytest.raises(ValueError, match=r"kv_chunk_blocks: .* 8 tokens"):
        _llm(checkpoint, num_blocks=32, kv_chunk_blocks=1, kv_host_cache_bytes=1 << 20)
