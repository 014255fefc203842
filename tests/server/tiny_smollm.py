"""A tiny random-weight Llama that speaks like the default model: SmolLM2's tokenizer and chat
template, a 32,768-token context, in the real Hugging Face format (config.json, safetensors,
tokenizer.json, tokenizer_config.json).

Its output is noise, but a 20,000-token prompt prefills in seconds on a CPU, where SmolLM2
takes minutes: what an agent client's full prompt needs to test the protocol end to end.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from deepinfer.model.loader.source import converted_gguf_dir, default_model_path
from deepinfer.tokenizer import Tokenizer

CONTEXT = 32768


def write_tiny_smollm(directory: Path, seed: int = 0) -> Path:
    source = converted_gguf_dir(default_model_path())
    tokenizer = Tokenizer.from_dir(source)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_ids[0],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(source / "tokenizer.json", directory / "tokenizer.json")
    eos = tokenizer.token_text(tokenizer.eos_token_ids[0])
    bos = tokenizer.token_text(tokenizer.bos_token_id)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tokenizer.chat_template, "eos_token": eos, "bos_token": bos})
    )
    return directory
