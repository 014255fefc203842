"""Engine options, shared by the offline `LLM`, `deepinfer serve` and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # a .gguf file or a HF directory; None = the embedded default model
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache (default 2 GiB on CPU, 90% free on GPU)
    num_blocks: int | None = None  # overrides kv_cache_memory
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    attention_backend: Literal["auto", "torch", "cpu_paged"] = "auto"
    num_threads: int | None = None
    # gguf: a GGUF's linears computed on its own packed blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K) by
    # native kernels, as llama.cpp does. int8: W8A8 linears on the CPU (int8 weights per channel,
    # per-token activation scales). none: the weights dense in `dtype` (a GGUF dequantized).
    # None: gguf for a GGUF file on the CPU, none otherwise.
    quantization: Literal["none", "int8", "gguf"] | None = None
    # float16: the KV cache in half precision (half the bytes decode attention reads, twice the
    # tokens per GiB); attention still computes in fp32. auto: the model's dtype.
    kv_cache_dtype: Literal["auto", "float16"] = "auto"
    # Speculative decoding (deepinfer/speculative): drafts verified by the target in one forward, lossless.
    speculative_method: Literal["ngram", "draft", "mtp"] | None = None
    num_speculative_tokens: int = 5  # most drafts verified per step
    speculative_length: Literal["fixed", "dynamic"] = "dynamic"
    speculative_model: str | None = None  # draft model for "draft" (None: the target drafts itself)
    speculative_ngram_min: int = 2  # shortest suffix n-gram "ngram" matches
    speculative_ngram_max: int = 4  # longest suffix n-gram tried first

    # KV tiers beyond device memory (deepinfer/store): a host-memory LRU and a persistent store.
    kv_store: str | None = None  # DIR | file://DIR | redis://HOST:PORT[/DB]
    kv_host_cache_bytes: str | None = None  # e.g. 8GiB
    kv_retention: str | None = None  # TTL per traffic class, e.g. agent=3d,chat=7d
    kv_store_max_bytes: str | None = None  # size cap of the persistent store
    kv_chunk_blocks: int | None = None  # full blocks per stored chunk (default 16)

    # Structured output: seconds one grammar (JSON schema, forced tool call) may take to compile
    # before its request is refused (the server checks on the API side too, answering 400).
    grammar_compile_timeout: float = 10.0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
