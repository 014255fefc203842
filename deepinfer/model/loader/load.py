"""Load a model and its tokenizer from any supported source, onto a device and dtype."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.model.base import CausalLM
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader.source import converted_gguf_dir, resolve_model_path, sampled_digest
from deepinfer.model.parallel import ModelParallel
from deepinfer.model.registry import model_class
from deepinfer.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    weights_fingerprint: str  # content identity of weights + tokenizer (+ quantization)
    quantization: str | None = None


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_model(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    parallel: ModelParallel | None = None,
) -> LoadedModel:
    """The model and its tokenizer; with `parallel`, only this rank's shard of the weights (the
    fingerprint stays the checkpoint's: every rank's prefix hashes agree)."""
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only (device {device.type})")
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        directory = converted_gguf_dir(path)
        meta = json.loads((directory / "meta.json").read_text())
        weights_id, name = meta["fingerprint"], meta["name"]
    elif path.is_dir():
        directory = path
        tokenizer_files = [p for p in (path / "tokenizer.json", path / "tokenizer_config.json") if p.exists()]
        weights_id = sampled_digest(sorted(path.glob("*.safetensors")) + tokenizer_files)
        name = path.name
    else:
        raise ValueError(f"unsupported model path {str(path)!r}: expected a .gguf file or a HF directory")

    config = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    tokenizer = Tokenizer.from_dir(directory)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    cls = model_class(config.model_type)
    with torch.device("meta"):
        net = cls.from_config(config) if parallel is None else cls.from_config(config, parallel)
    net = net.to_empty(device=device).to(dtype)
    net.load_weights(iter_safetensors(directory))
    net.eval()
    identity = f"{weights_id}:{config.model_type}"
    if quantization is not None:
        net.quantize(quantization)
        identity += f":{quantization}"  # other numerics, other KV: never a prefix hit across them
    fingerprint = hashlib.sha256(identity.encode()).hexdigest()
    return LoadedModel(net, config, tokenizer, name, fingerprint, quantization)
