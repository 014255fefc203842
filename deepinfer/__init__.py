"""DeepInfer: an LLM inference engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from deepinfer.entrypoints.llm import LLM
    from deepinfer.outputs import CompletionOutput, RequestOutput
    from deepinfer.sampling_params import SamplingParams, StructuredOutputs

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str):
    # Lazy: `import deepinfer.recipe` must work without torch, so the package root imports nothing heavy.
    if name == "LLM":
        from deepinfer.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputs"):
        from deepinfer import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from deepinfer import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
