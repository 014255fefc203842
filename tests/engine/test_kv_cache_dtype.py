"""kv_cache_dtype="float16": half the KV bytes, fp32 attention, greedy output batch-invariant.
The default ("auto") for a model on a GGUF's own blocks is 16 bits: bf16 where the CPU attention
computes it in bf16 products, fp16 (as llama.cpp keeps it) elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.attention.cpu_paged import bf16_products
from deepinfer.config import CacheConfig, EngineConfig
from deepinfer.engine.build import kv_cache_dtype
from deepinfer.kernels import isa
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


def test_auto_is_16_bits_for_a_gguf_and_the_model_dtype_otherwise(default_llm: LLM, dense_llm: LLM) -> None:
    def dtypes(llm: LLM) -> set[str]:
        return {t.dtype for g in llm.engine.core.layout.groups for t in g.group.tensors}

    # quantization="gguf": bf16 where this CPU has bf16 instructions (the kernel's products on
    # them), else fp16
    assert dtypes(default_llm) == {"bfloat16" if isa.runs_bfloat16() else "float16"}
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


def test_auto_takes_bf16_for_a_gguf_only_where_its_attention_computes_in_bf16(
    default_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = default_llm.engine.core.loaded
    head_dim = loaded.model.attention_shape()[2]
    cpu = torch.device("cpu")

    def auto(**options: str) -> torch.dtype:
        return kv_cache_dtype(EngineConfig.from_kwargs(**options), loaded, torch.float32, cpu)

    assert auto() == (torch.bfloat16 if bf16_products(head_dim) else torch.float16)
    assert bf16_products(head_dim) == isa.runs_bfloat16()  # the kernel's self-check passes here
    assert not bf16_products(96)  # a head size the bf16 products do not cover: the fp32 path
    assert auto(attention_backend="torch") == torch.float16  # the reference computes in fp32
    assert (
        kv_cache_dtype(EngineConfig.from_kwargs(), loaded, torch.float32, torch.device("meta"))
        == torch.float16
    )
    assert auto(kv_cache_dtype="float16") == torch.float16  # asked for: as given
    monkeypatch.setenv(isa.ENV, "avx2")  # a CPU without bf16 instructions: that kernel build's answer
    assert auto() == torch.float16
