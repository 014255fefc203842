"""kv_cache_dtype="float16": half the KV bytes, fp32 attention, greedy output batch-invariant; the
default ("auto") for a model on a GGUF's own blocks, as llama.cpp keeps it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import CacheConfig, EngineConfig
from tests.engine.greedy import CHAT, assert_greedy_batch_invariant


@pytest.fixture(scope="module")
def half_kv_llm(dense_llm: LLM) -> Iterator[LLM]:
    """fp32 weights with an fp16 KV cache: the KV precision alone (with quantization="gguf" a
    perturbation this small also moves int8 activation roundings, which dwarfs it)."""
    llm = LLM(
        loaded=dense_llm.engine.core.loaded,
        kv_cache_memory=64 << 20,
        kv_cache_dtype="float16",
        quantization="none",
    )
    yield llm
    llm.close()


def test_half_kv_holds_twice_the_tokens_and_stays_close(dense_llm: LLM, half_kv_llm: LLM) -> None:
    full = dense_llm.engine.core
    half = half_kv_llm.engine.core
    assert {t.dtype for g in half.layout.groups for t in g.group.tensors} == {"float16"}
    assert half.kv_bytes_per_token * 2 == full.kv_bytes_per_token
    assert half.fingerprint != full.fingerprint  # other KV bytes: never a prefix hit across them
    text = CHAT.format("What is the capital of France?") + "The capital of France is Paris, on the Seine."
    ids = dense_llm.get_tokenizer().encode(text)
    reference, halved = full.score(ids), half.score(ids)
    assert (reference - halved).abs().max().item() < 0.1
    assert torch.equal(reference.argmax(-1), halved.argmax(-1))


def test_half_kv_greedy_is_identical_alone_and_batched(half_kv_llm: LLM) -> None:
    assert_greedy_batch_invariant(half_kv_llm)


def test_half_kv_round_trips_through_the_store(default_llm: LLM, tmp_path: Path) -> None:
    loaded = default_llm.engine.core.loaded
    prompt = default_llm.get_tokenizer().encode(" ".join(f"word{i}" for i in range(400)))
    params = SamplingParams(temperature=0, max_tokens=8)
    options = {"kv_cache_memory": 64 << 20, "kv_cache_dtype": "float16", "kv_store": str(tmp_path)}
    first = LLM(loaded=loaded, **options)
    [cold] = first.generate([prompt], params, use_tqdm=False)
    first.close()  # flushes the write-behind queue
    second = LLM(loaded=loaded, **options)
    [warm] = second.generate([prompt], params, use_tqdm=False)
    second.close()
    assert warm.num_cached_tokens >= 256 and cold.num_cached_tokens == 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_bad_kv_cache_dtype_is_named(default_llm: LLM) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(loaded=default_llm.engine.core.loaded, kv_cache_memory=16 << 20, kv_cache_dtype="int4")


def test_auto_is_half_for_a_gguf_and_the_model_dtype_otherwise(default_llm: LLM, dense_llm: LLM) -> None:
    def dtypes(llm: LLM) -> set[str]:
        return {t.dtype for g in llm.engine.core.layout.groups for t in g.group.tensors}

    assert dtypes(default_llm) == {"float16"}  # quantization="gguf"
    assert dtypes(dense_llm) == {"float32"}  # the same file dequantized: the model's dtype
    full = LLM(loaded=default_llm.engine.core.loaded, kv_cache_memory=16 << 20, kv_cache_dtype="float32")
    try:
        assert dtypes(full) == {"float32"}
        assert full.engine.core.kv_bytes_per_token == 2 * default_llm.engine.core.kv_bytes_per_token
    finally:
        full.close()


def test_a_full_precision_cache_needs_a_full_precision_model() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(dtype="bfloat16", cache=CacheConfig(kv_cache_dtype="float32"))
