"""Tiny random Llama-family checkpoints the Triton engine tests share (SmolLM2's tokenizer): a
plain Llama and a Qwen2 with sliding-window layers (two cache groups, one windowed)."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, Qwen2Config

from deepinfer import LLM, SamplingParams
from deepinfer.model.loader.source import converted_gguf_dir
from tests.engine.test_parity_tiny import COMMON, make_checkpoint

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen2-sliding": lambda: Qwen2Config(
        **COMMON,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
}


def write_checkpoint(name: str, directory: Path, default_model_path: Path) -> Path:
    """CONFIGS[name] with random weights written to `directory`."""
    make_checkpoint(name, directory, converted_gguf_dir(default_model_path), CONFIGS[name]())
    return directory


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]
