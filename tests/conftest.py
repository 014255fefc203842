"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import os

import pytest

# Tests share 2 cores; keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def default_llm():
    from deepinfer import LLM

    return LLM(kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def default_model_path():
    from deepinfer.model.loader.source import default_model_path

    return default_model_path()
