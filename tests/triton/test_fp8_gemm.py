"""The FP8 block-scaled linear (kernels/triton/fp8_gemm.py, model/layers/fp8_linear.py) against
dequantize-then-matmul (layers/fp8.py), and where the weights are kept in FP8."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import ConfigError
from deepinfer.kernels.triton.fp8_gemm import fp8_block_linear
from deepinfer.model.layers import fp8_linear
from deepinfer.model.layers.fp8 import dequantize_block_fp8
from deepinfer.model.layers.fp8_linear import Fp8BlockLinear, fp8_weights_kept, keeps_fp8_weights


def _weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=generator) * 1e-3 + 1e-4
    return weight, scales


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(
    ("n", "k", "block"), [(200, 300, (128, 128)), (64, 256, (128, 128)), (96, 64, (32, 32))]
)
def test_fp8_block_linear_equals_dequantized_matmul(device, m, n, k, block):
    weight, scales = _weight(n, k, block, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = x.double() @ dequantize_block_fp8(weight, scales, block).double().t()
    dtypes = (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        got = fp8_block_linear(x.to(device, dtype), weight.to(device), scales.to(device), block)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the activations' own rounding
        torch.testing.assert_close(
            got.double().cpu(), expected, rtol=tol, atol=tol * expected.abs().max().item()
        )


def test_fp8_block_linear_refuses_mismatched_scales(device):
    weight, scales = _weight(200, 300, (128, 128), seed=1)
    with pytest.raises(ValueError, match="do not make"):
        fp8_block_linear(torch.zeros(2, 300, device=device), weight.to(device), scales[:1].to(device))


def test_layer_takes_any_leading_shape_and_a_bias(device):
    weight, scales = _weight(130, 256, (128, 128), seed=3)
    bias = torch.randn(130)
    layer = Fp8BlockLinear(weight.to(device), scales.to(device), bias.to(device))
    x = torch.randn(2, 3, 256)
    dense = torch.nn.functional.linear(x, dequantize_block_fp8(weight, scales), bias)
    torch.testing.assert_close(layer(x.to(device)).cpu(), dense, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8BlockLinear(weight.float(), scales)


def test_fp8_weights_kept_only_on_cuda_of_capability_8_9(monkeypatch):
    assert not fp8_weights_kept(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    for capability, kept in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device, c=capability: c)
        assert fp8_weights_kept(cuda) is kept
    monkeypatch.setattr(fp8_linear, "triton_installed", lambda: False)
    assert not fp8_weights_kept(cuda)


def test_fp8_weights_option_keeps_only_where_the_kernel_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert not keeps_fp8_weights("auto", True, cpu)  # the CPU dequantizes unless told to keep
    assert not keeps_fp8_weights("dequantize", True, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert keeps_fp8_weights("keep", True, cpu)
    with pytest.raises(ConfigError, match="attention_backend=triton"):
        keeps_fp8_weights("keep", False, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        keeps_fp8_weights("keep", True, cpu)
