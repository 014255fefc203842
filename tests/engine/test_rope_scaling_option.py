"""`rope_scaling` given to the engine (`--rope-scaling`): a checkpoint without scaling, run with
YaRN from the option, computes what HF transformers computes for the same weights with that
scaling in their config, at positions past the trained context; and the context the engine
allows grows with it (past it, or past the trained one without it, is refused)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from deepinfer import LLM
from deepinfer.config import ConfigError
from deepinfer.model.loader.source import converted_gguf_dir
from tests.engine.test_parity_tiny import COMMON, make_checkpoint

TRAINED = 128
YARN = {"rope_type": "yarn", "factor": 4.0}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_path):
    """A random Llama trained (as its config says) on 128 positions, and HF's model of the same
    weights with YaRN x4 in its config."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    common = {**COMMON, "max_position_embeddings": TRAINED}
    trained = make_checkpoint(
        "rope-option", directory, converted_gguf_dir(default_model_path), LlamaConfig(**common)
    )
    scaled = LlamaConfig(
        **{**common, "max_position_embeddings": 4 * TRAINED},
        rope_parameters={"rope_theta": 10000.0, **YARN, "original_max_position_embeddings": TRAINED},
    )
    hf = AutoModelForCausalLM.from_config(scaled, dtype=torch.float32).eval()
    hf.load_state_dict(trained.state_dict())
    return directory, hf


def test_the_option_computes_hf_yarn_past_the_trained_context(tiny_dir) -> None:
    directory, hf = tiny_dir
    llm = LLM(model=str(directory), num_blocks=64, rope_scaling=YARN, max_model_len=4 * TRAINED)
    try:
        assert llm.engine.core.max_model_len == 4 * TRAINED
        prompt = [(7 * j) % 49000 + 100 for j in range(3 * TRAINED)]  # positions up to 3x the trained
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(llm.engine.core.score(prompt), expected, atol=1e-4, rtol=0)
    finally:
        llm.close()


def test_the_context_is_bounded_by_what_the_model_places(tiny_dir) -> None:
    directory, _ = tiny_dir
    with pytest.raises(
        ConfigError, match=f"{2 * TRAINED} tokens is beyond the model's trained context of {TRAINED}"
    ):
        LLM(model=str(directory), num_blocks=64, max_model_len=2 * TRAINED)
    with pytest.raises(ConfigError, match=f"beyond the {4 * TRAINED} tokens this --rope-scaling reaches"):
        LLM(model=str(directory), num_blocks=64, rope_scaling=YARN, max_model_len=8 * TRAINED)
