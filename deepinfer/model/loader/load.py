"""Load a model and its tokenizer from any supported source, onto a device and dtype."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deepinfer.config import ConfigError, EngineConfig, ParallelConfig
from deepinfer.kernels import isa
from deepinfer.kernels.bf16_matmul import bf16_kernels
from deepinfer.kernels.gguf_blocks import PackedMatrix, gguf_kernels
from deepinfer.model.base import CausalLM, refuse_encoders, refuse_truncation
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader.preflight import check_context
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
    quantization: str | None = None  # as requested (None: the model's default)
    resolved_quantization: str | None = None  # what it runs with: None (dense), "int8" or "gguf"


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def resolve_quantization(
    requested: str | None, is_gguf: bool, dtype: torch.dtype, device: torch.device
) -> str | None:
    """The numerics a model runs with: None (its weights dense, in `dtype`), "int8" or "gguf".

    The default (None) is "gguf" for a GGUF file on the CPU in float32: the file's own blocks,
    no second conversion, as accurate as its fp32 dequantization and faster; dense otherwise."""
    if requested is None:
        native = is_gguf and device.type == "cpu" and dtype == torch.float32
        return "gguf" if native and gguf_kernels() is not None else None
    if requested == "none":
        return None
    if device.type != "cpu":
        raise ValueError(f"quantization={requested!r} runs on the CPU only (device {device.type})")
    if requested == "gguf":
        if not is_gguf:
            raise ValueError("quantization='gguf' needs a .gguf model file")
        if dtype != torch.float32:
            raise ValueError(f"quantization='gguf' computes in float32, not {dtype}")
    return requested


def adopt_packed_gguf(
    net: CausalLM, gguf_path: Path, hf_config: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    """Hand `net` (still on the meta device) the GGUF's packed weights it computes on; return the
    others dense for load_weights (norms, biases, formats without a native kernel)."""
    import gguf

    from deepinfer.model.loader.gguf_file import iter_weights
    from deepinfer.model.loader.gguf_tensors import read_tensors

    packed: dict[str, PackedMatrix] = {}
    dense: list[tuple[str, torch.Tensor]] = []
    for name, weight in iter_weights(read_tensors(gguf_path), hf_config, packed=True):
        if isinstance(weight, PackedMatrix):
            packed[name] = weight
        else:
            dense.append((name, weight))
    taken = net.use_packed_weights(packed)
    for name in sorted(packed.keys() - taken):
        matrix = packed[name]
        values = gguf.quants.dequantize(matrix.data, gguf.GGMLQuantizationType(matrix.qtype))
        dense.append((name, torch.from_numpy(values.astype("float32"))))
    return dense


def check_model_parallel(model: str | Path | None, parallel: ParallelConfig) -> None:
    """Refuse before any rank starts a split the model of an HF directory does not support (its
    class's `check_parallel`); GGUF files (the Llama family) are checked as each rank loads."""
    path = resolve_model_path(model)
    if not path.is_dir():
        return
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model_class(config.model_type).check_parallel(config, parallel)


def check_model_engine(config: EngineConfig) -> None:
    """Refuse before any weight loads an engine feature the model of an HF directory does not
    run (its class's `check_engine`); GGUF files are the Llama family, which runs them all but
    YoCo's bounded replay and image encoders; and a max_model_len past the context the model
    places, read from its files (the engine checks again on the loaded config)."""
    path = resolve_model_path(config.model)
    check_context(path, config.scheduler.max_model_len, config.rope_scaling)
    if not path.is_dir():
        refuse_truncation(config)
        refuse_encoders(config)
        return
    model_config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model_class(model_config.model_type).check_engine(model_config, config)


def allocate_weights(net: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device`, floating point
    ones in `dtype` (what `to_empty(device).to(dtype)` does, without its per-tensor empty_like,
    which imports sympy on first use: 1.4 s of every engine start). Mutates `net` in place;
    tensors shared between modules stay shared."""
    allocated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor kept alive, storage)

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in allocated:
            kind = dtype if t.is_floating_point() else t.dtype
            allocated[id(t)] = (t, torch.empty(t.shape, dtype=kind, device=device))
        return allocated[id(t)][1]

    for module in net.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)


def bf16_kernels_used(net: CausalLM) -> bool:
    """Whether `net` (bf16, on the CPU) now runs its projections on the C kernel: only where the
    selected instruction-set level has bf16 arithmetic (the portable build is a reference, slower
    than torch) and a C compiler built it."""
    kernels = bf16_kernels() if isa.runs_bfloat16() else None
    return kernels is not None and net.use_bf16_kernels(kernels)


def load_model(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    parallel: ModelParallel | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    keep_fp8: bool = False,
) -> LoadedModel:
    """The model and its tokenizer; with `parallel`, only this rank's shard of the weights (the
    fingerprint stays the checkpoint's: every rank's prefix hashes agree); with `rope_scaling`
    (checked by EngineConfig), that scaling in place of the checkpoint's; with `keep_fp8`, the
    FP8 weights of the layers the model can keep in FP8 (`keep_fp8_weights`) not dequantized."""
    if quantization is not None and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only (device {device.type})")
    path = resolve_model_path(model)
    is_gguf = path.is_file() and path.suffix == ".gguf"
    split = parallel is not None and parallel.tp.size > 1
    # Packed GGUF layers are not split over ranks: a tensor-parallel rank dequantizes its shard.
    resolved = resolve_quantization(quantization, is_gguf and not split, dtype, device)
    if is_gguf:
        directory = converted_gguf_dir(path, with_weights=resolved != "gguf")
        meta = json.loads((directory / "meta.json").read_text())
        weights_id, name = meta["fingerprint"], meta["name"]
    elif path.is_dir():
        directory = path
        tokenizer_files = [p for p in (path / "tokenizer.json", path / "tokenizer_config.json") if p.exists()]
        weights_id = sampled_digest(sorted(path.glob("*.safetensors")) + tokenizer_files)
        name = path.name
    else:
        raise ValueError(f"unsupported model path {str(path)!r}: expected a .gguf file or a HF directory")

    hf_config = json.loads((directory / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    tokenizer = Tokenizer.from_dir(directory)
    if not config.eos_token_ids:
        config.eos_token_ids = list(tokenizer.eos_token_ids)
    cls = model_class(config.model_type)
    if rope_scaling is not None:
        if not cls.takes_rope_scaling:
            raise ConfigError(
                "rope_scaling",
                f"{config.model_type!r} places positions its own way: it takes no RoPE scaling",
            )
        config.scale_rope(rope_scaling)
    net = cls.from_checkpoint(directory, config, device, dtype) if path.is_dir() and not split else None
    kept_fp8: list[str] = []
    if net is None:
        with torch.device("meta"):
            net = cls.from_config(config) if parallel is None else cls.from_config(config, parallel)
        # packed layers replace dense ones before anything is allocated
        weights = (
            adopt_packed_gguf(net, path, hf_config) if resolved == "gguf" else iter_safetensors(directory)
        )
        allocate_weights(net, device, dtype)
        kept_fp8 = net.keep_fp8_weights() if keep_fp8 else []
        net.load_weights(weights)
    net.eval()
    identity = f"{weights_id}:{config.model_type}"
    if rope_scaling is not None:  # other positions, other keys: never a prefix hit across them
        identity += ":rope=" + json.dumps(config.rope_scaling, sort_keys=True)
    if kept_fp8:  # summed in another order than dequantized weights: never a prefix hit across them
        identity += ":fp8"
    if dtype != torch.float32:  # a bf16 run of a checkpoint writes other KV than its fp32 run
        identity += f":{str(dtype).removeprefix('torch.')}"
    if dtype is torch.bfloat16 and device.type == "cpu" and resolved is None and bf16_kernels_used(net):
        identity += ":bf16-kernel"  # other sums than torch's GEMM: other KV
    if resolved is not None:
        if resolved != "gguf":
            net.quantize(resolved)
        identity += f":{resolved}"  # other numerics, other KV: never a prefix hit across them
    fingerprint = hashlib.sha256(identity.encode()).hexdigest()
    return LoadedModel(net, config, tokenizer, name, fingerprint, quantization, resolved)
