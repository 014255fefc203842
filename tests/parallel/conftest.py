"""A tiny DeepSeek-V3 checkpoint (as tests/deepseek builds them), prompts for it, and the
single-process outputs every parallel engine must reproduce."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from tests.deepseek.conftest import VARIANTS
from tests.deepseek.tiny_checkpoint import TinyCheckpoint, build_checkpoint
from tests.parallel.helpers import DEEPSEEK_PARAMS


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
