"""Tiny DeepSeek-V3 and V4 checkpoints (as tests/deepseek and tests/deepseek_v4 build them),
prompts for them, and the single-process outputs every parallel engine must reproduce."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from tests.deepseek.conftest import VARIANTS
from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint
from tests.deepseek_v4.tiny_v4 import TinyV4, build_v4, tiny_config
from tests.parallel.helpers import DEEPSEEK_PARAMS, V4_ENGINE


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory) -> TinyCheckpoint:
    overrides, fp8, seed = VARIANTS["v3"]
    return build_checkpoint(tmp_path_factory.mktemp("v3-parallel"), overrides, fp8=fp8, seed=seed)


@pytest.fixture(scope="session")
def prompts(tiny_v3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = tiny_v3.config["vocab_size"]
    shared = torch.randint(3, vocab, (40,), generator=generator).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 30)] + [
        torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (70, 12, 3)
    ]


@pytest.fixture(scope="session")
def reference(tiny_v3, prompts):
    llm = LLM(model=str(tiny_v3.path), num_blocks=128, num_threads=1)
    alone = [llm.generate([p], DEEPSEEK_PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    logits = [llm.engine.core.score(p) for p in prompts[:3]]
    llm.close()
    return alone, logits


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory) -> TinyV4:
    """Sliding, CSA (m=4) and HCA (m=8) layers, window 8, two hash-routed layers, 4 query heads in
    2 output groups, 8 routed experts; no MTP (speculative decoding does not run over ranks)."""

    def config(vocab_size: int) -> dict:
        return tiny_config(vocab_size, num_nextn_predict_layers=0)

    return build_v4(tmp_path_factory.mktemp("v4-parallel"), config, seed=5)


@pytest.fixture(scope="session")
def v4_prompts(tiny_v4) -> list[list[int]]:
    """Two sharing a 24-token prefix, and lengths inside one window up to several HCA windows."""
    generator = torch.Generator().manual_seed(9)
    vocab = tiny_v4.config["vocab_size"]
    shared = torch.randint(3, vocab, (24,), generator=generator).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 21)] + [
        torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (61, 9, 3)
    ]


@pytest.fixture(scope="session")
def v4_reference(tiny_v4, v4_prompts):
    """Single-process greedy outputs of each prompt alone, the logits of the first three, and the
    text of the first output."""
    llm = LLM(model=str(tiny_v4.path), **V4_ENGINE)
    outputs = [llm.generate([p], DEEPSEEK_PARAMS, use_tqdm=False)[0].outputs[0] for p in v4_prompts]
    logits = [llm.engine.core.score(p) for p in v4_prompts[:3]]
    llm.close()
    return [o.token_ids for o in outputs], logits, outputs[0].text
