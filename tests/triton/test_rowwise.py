"""RMSNorm (+ residual) and rotary kernels against the model's torch layers."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.rms_norm import rms_norm
from deepinfer.kernels.triton.rotary import rotary_
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.rotary import RotaryEmbedding

# Triton's interpreter rounds float32 to bfloat16 by truncation, the GPU to nearest: one bf16 step.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 80])
def test_rms_norm_with_and_without_residual(dtype, hidden, device):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x, residual = torch.randn(5, hidden, dtype=dtype), torch.randn(5, hidden, dtype=dtype)
    expected_out, expected_sum = norm.add_forward(x, residual)
    weight = norm.weight.data.to(device)
    out, total = rms_norm(x.to(device), weight, 1e-6, residual.to(device))
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(total.cpu(), expected_sum, atol=atol, rtol=rtol)
    torch.testing.assert_close(out.cpu(), expected_out, atol=atol, rtol=rtol)
    x = x.to(device)
    alone, same = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(alone.cpu(), norm(x.cpu()), atol=atol, rtol=rtol)
    assert same is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_model_layer(dtype, device):
    """q and k heads as one strided view of a fused qkv row, as the attention layer passes them."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(32, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 16})  # fmt: skip
    qkv = torch.randn(6, 4 + 2 + 2, 32, dtype=dtype)
    positions = torch.tensor([0, 5, 17, 63, 2, 40])
    expected = rope(positions, qkv[:, :6])[0]
    cos, sin = rope.tables(torch.device(device), dtype)
    x = qkv.to(device)
    rotary_(x[:, :6], positions.to(device), cos, sin)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(x[:, :6].cpu(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(x[:, 6:].cpu(), qkv[:, 6:], atol=0, rtol=0)  # V untouched
