"""Every step of a model with a one-call layer stack run both ways: layer by layer, then in one C
call (kernels/decode_layers.c on packed GGUF weights, kernels/bf16_layers.c on bf16 ones)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.decode_layers import DecodeStack


def record_both_paths(
    runner, monkeypatch: pytest.MonkeyPatch, stack: type = DecodeStack
) -> list[tuple[int, bool, bool]]:
    """Patch `runner.forward` so that each step runs layer by layer first, then through the
    one-call path (`stack`, writing the same K/V again), whose output goes on.
    Returns the list that fills, step by step, with (tokens, one call ran, same bits)."""
    model, inner = runner.model, runner.forward
    fused_calls: list[int] = []
    steps: list[tuple[int, bool, bool]] = []

    def both_paths(inputs, spans, features=None):
        model.fused_decode = False
        try:
            reference = inner(inputs, spans, features)
        finally:
            model.fused_decode = True
        before = len(fused_calls)
        fused = inner(inputs, spans, features)
        steps.append((len(inputs.input_ids), len(fused_calls) > before, torch.equal(fused, reference)))
        return fused

    stack_run = stack.run
    monkeypatch.setattr(stack, "run", lambda self, *a: fused_calls.append(1) or stack_run(self, *a))
    monkeypatch.setattr(runner, "forward", both_paths)
    return steps
