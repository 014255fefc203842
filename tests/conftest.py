"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# Tests share 2 cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton reads TRITON_INTERPRET when a kernel is decorated, and any test module (through the
# model runner) may import deepinfer.kernels.triton first: on the CPU the interpreter runs them.
# deepinfer/bench/device_check.sh sets DEEPINFER_TEST_DEVICE=cuda to compile them for the GPU instead.
if os.environ.get("DEEPINFER_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


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
