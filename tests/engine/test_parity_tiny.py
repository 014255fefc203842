"""Tiny random Llama / Qwen2 / Qwen3 checkpoints (made here, no downloads) against HF transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from deepinfer import LLM, SamplingParams
from deepinfer.model.loader.source import converted_gguf_dir

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
)
CONFIGS = {
    "llama3-scaled-rope": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen2-qkv-bias": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False, use_sliding_window=False),
    "qwen3-qk-norm": lambda: Qwen3Config(
        **COMMON, head_dim=32, tie_word_embeddings=True, use_sliding_window=False
    ),
}


def make_checkpoint(name: str, directory, tokenizer_dir, config=None) -> torch.nn.Module:
    """A random checkpoint of CONFIGS[name] (or `config`), seeded by the name."""
    torch.manual_seed(sum(map(ord, name)))
    config = config if config is not None else CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked distributions: random init at std 0.02 gives near-ties everywhere
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
            elif "norm" not in str(param):
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(tokenizer_dir / "tokenizer.json", directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )
    return model


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_path):
    return converted_gguf_dir(default_model_path)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_model_matches_hf(name, tmp_path, tokenizer_dir):
    hf = make_checkpoint(name, tmp_path, tokenizer_dir)
    llm = LLM(model=str(tmp_path), num_blocks=64, max_num_batched_tokens=256)
    ids = [[(7 * i + 3 * j) % 49000 + 100 for j in range(40 + 9 * i)] for i in range(3)]
    for prompt in ids:
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(llm.engine.core.score(prompt), expected, atol=1e-4, rtol=0)
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for prompt, output in zip(ids, outputs):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
