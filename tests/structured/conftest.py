"""Fixtures: the default model's real tokenizer (from its GGUF) and an llguidance backend on it."""

from __future__ import annotations

import pytest

from deepinfer.structured.llguidance_backend import LLGuidanceBackend
from deepinfer.structured.tokenizer_info import TokenizerInfo


@pytest.fixture(scope="session")
def hf_tokenizer():
    """SmolLM2's tokenizer built from the GGUF vocabulary by transformers (no download)."""
    from transformers import AutoTokenizer

    from deepinfer.model.loader.source import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def tokenizer_info(hf_tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_backend_tokenizer(hf_tokenizer.backend_tokenizer, [hf_tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def backend(tokenizer_info) -> LLGuidanceBackend:
    return LLGuidanceBackend(tokenizer_info)
