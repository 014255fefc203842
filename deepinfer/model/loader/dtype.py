"""The dtype a model computes in: `dtype=auto` read off the checkpoint, the model class and the CPU.

Real HF checkpoints are bf16 (some fp16): those values are the exact weights. On a CPU with
native bf16 arithmetic (AVX512-BF16, AMX) torch runs bf16 GEMMs through oneDNN about twice as fast
as fp32 from a few rows up, on half the weight bytes (docs/architecture.md, "Instruction sets"),
so `auto` keeps such a checkpoint in bf16 there. Elsewhere oneDNN emulates bf16, slower than fp32,
so `auto` widens it to fp32, as it runs fp32 checkpoints and GGUF files (whose kernels compute in
fp32). `DEEPINFER_CPU_ISA` set below avx512_bf16 stands for a CPU without it. An explicit
`--dtype bfloat16` is honoured everywhere, as vLLM's CPU backend does (AVX512-BF16 is optional
there), with a warning where it is emulated.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import torch

from deepinfer.config import ConfigError, EngineConfig
from deepinfer.kernels import isa
from deepinfer.model.config import ModelConfig
from deepinfer.model.loader.source import resolve_model_path
from deepinfer.model.registry import model_class

log = logging.getLogger(__name__)

# safetensors dtype names of the floating point formats a checkpoint stores its values in
_HALF = {"BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(directory: Path) -> str | None:
    """The floating point dtype of a safetensors checkpoint's tensors, from the first file's
    header (8 bytes of length, then JSON; no tensor is read): "bfloat16" or "float16" when its
    matrices are stored so (fp32 norms beside them do not count), else "float32"; None when
    there is no safetensors file."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    with files[0].open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    kinds = {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}
    for kind, name in _HALF.items():
        if kind in kinds:
            return name
    return "float32"


def auto_cpu_dtype(config: EngineConfig) -> torch.dtype:
    """`dtype=auto` on the CPU: bf16 for a bf16/fp16 HF checkpoint of a model class that computes
    in bf16 on the CPU, dense (no `quantization`), on a CPU with native bf16; fp32 otherwise."""
    path = resolve_model_path(config.model)
    if not path.is_dir() or config.quantization not in (None, "none") or not isa.runs_bfloat16():
        return torch.float32
    cls = model_class(ModelConfig.from_hf(json.loads((path / "config.json").read_text())).model_type)
    if cls.cpu_bfloat16 and checkpoint_dtype(path) in _HALF.values():
        return torch.bfloat16
    return torch.float32


def engine_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The dtype the engine loads the weights in and computes with. auto: bf16 on CUDA, on the
    CPU `auto_cpu_dtype` (an fp32 KV cache asked for beside it: refused, before any weight
    loads); an explicit one as given (bf16 on a CPU that emulates it: a warning)."""
    if config.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else auto_cpu_dtype(config)
        if dtype is torch.bfloat16 and config.cache.kv_cache_dtype == "float32":
            # EngineConfig refuses it for an explicit bf16; auto's bf16 is known only here
            raise ConfigError(
                "kv_cache_dtype",
                "float32 needs an fp32 model: dtype=auto runs this one in bfloat16 (add --dtype float32)",
            )
        return dtype
    dtype = getattr(torch, config.dtype)
    if device.type == "cpu" and dtype is torch.bfloat16 and not isa.runs_bfloat16():
        log.warning(
            "dtype=bfloat16 on a CPU without AVX512-BF16 or AMX (%s): bf16 is emulated, slower "
            "than float32 (dtype=auto picks float32 here)",
            isa.describe(),
        )
    return dtype


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a loaded model computes in: its first floating point parameter's (a model on
    packed GGUF blocks keeps its norms in fp32)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
