"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# Tests share 2 cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def default_llm():
    """The default model as a user gets it (quantization="gguf": the file's own blocks)."""
    from deepinfer import LLM

    return LLM(kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def dense_llm():
    """The default model dequantized to fp32 (quantization="none"): the reference for parity with
    HF transformers and for the quantized modes."""
    from deepinfer import LLM

    return LLM(kv_cache_memory=128 << 20, quantization="none")


@pytest.fixture(scope="session")
def default_model_path():
    from deepinfer.model.loader.source import default_model_path

    return default_model_path()
