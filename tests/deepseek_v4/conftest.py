"""Tiny random DeepSeek-V4 checkpoints (built once per session), loaded the way `deepinfer` loads them."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.loader.load import load_model
from tests.deepseek_v4.oracle_cache import ContiguousV4Cache
from tests.deepseek_v4.tiny_v4 import TinyV4, build_v4, official_config, tiny_config
from tests.one_thread import one_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyV4:
    """transformers' config dialect: sliding, CSA (m=4, top-3), HCA (m=8), window 8, hc_mult 4."""
    return build_v4(tmp_path_factory.mktemp("v4_tiny"), tiny_config, seed=0)


WINDOW = 16


def _windowed_config(vocab_size: int) -> dict:
    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    return tiny_config(vocab_size, sliding_window=WINDOW, max_position_embeddings=512, rope_parameters=rope)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> TinyV4:
    """The engine tests' checkpoint: a 16-token window (several blocks of 4), YaRN, MTP."""
    return build_v4(tmp_path_factory.mktemp("v4_engine"), _windowed_config, seed=11)


@pytest.fixture(scope="session")
def tiny_model(tiny):
    return load_model(tiny.path, torch.float32, torch.device("cpu")).model


@pytest.fixture(scope="session")
def quantized(tmp_path_factory) -> TinyV4:
    """DeepSeek's published dialect, FP8 (e8m0 128x128 scales) with MXFP4 experts, HCA at m=128."""
    return build_v4(tmp_path_factory.mktemp("v4_quantized"), official_config, seed=3, quantize=True)


class CachedRun:
    """Drives a model step by step over one ContiguousV4Cache, as the engine would."""

    def __init__(self, model: torch.nn.Module, release: bool = True) -> None:
        self.model = model
        self.cache = ContiguousV4Cache(model.cache_declarations(), torch.float32, torch.device("cpu"))
        self.release = release
        self.lengths: dict[int, int] = {}

    def new_sequence(self) -> int:
        seq = self.cache.add_sequence()
        self.lengths[seq] = 0
        return seq

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feeds each sequence its chunk in one step; returns each chunk's streams [n, hc, hidden]."""
        seqs = list(chunks)
        layout = StepLayout(tuple(self.lengths[s] for s in seqs), tuple(len(chunks[s]) for s in seqs))
        ids = torch.tensor([t for s in seqs for t in chunks[s]])
        positions = torch.cat([torch.arange(self.lengths[s], self.lengths[s] + len(chunks[s])) for s in seqs])
        streams = self.model.forward_cached(ids, positions, layout, self.cache.step(seqs, layout))
        offsets = layout.offsets
        for s in seqs:
            self.lengths[s] += len(chunks[s])
            if self.release:
                self.cache.release(s, self.lengths[s])
        return [streams[offsets[i] : offsets[i + 1]] for i in range(len(seqs))]

    def logits(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [self.model.compute_logits(s) for s in self.step(chunks)]
