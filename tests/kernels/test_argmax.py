"""rowwise.c's greedy argmax against torch.argmax, at every instruction-set level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.rowwise import rowwise_kernels
from deepinfer.runner.sampler import greedy_tokens


def _rows() -> torch.Tensor:
    """Rows whose answers are easy to get wrong: ties (the first wins), NaNs (the first NaN
    wins), all -inf, signed zeros, the maximum in the tail past the last 16, and a row of one
    value repeated."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(12, 49157, generator=generator)  # 3072 vectors of 16 and a tail of 5
    x[0, [5, 900, 40000]] = 50.0
    x[1, [7, 30]] = float("nan")
    x[1, 3] = float("inf")
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, 10] = -0.0
    x[4, -1] = 60.0
    x[5] = 2.5
    x[6, 49152] = float("nan")
    x[7, 17] = float("inf")
    return x


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_argmax_is_torch_argmax(level: isa.Level) -> None:
    kernels = rowwise_kernels(level.compiler_flags)
    assert kernels is not None
    x = _rows()
    assert kernels.argmax(x) == x.argmax(dim=-1).tolist()
    strided = x[:, 1:]  # rows 49157 floats apart, one shorter
    assert kernels.argmax(strided) == strided.argmax(dim=-1).tolist()
    assert kernels.argmax(x[:1, :3]) == x[:1, :3].argmax(dim=-1).tolist()


def test_greedy_tokens_take_the_kernel_or_torch() -> None:
    x = _rows()
    assert greedy_tokens(x) == x.argmax(dim=-1).tolist()
    half = x.to(torch.float16)  # not the kernel's: torch answers
    assert greedy_tokens(half) == half.argmax(dim=-1).tolist()
    with pytest.raises(ValueError, match="float32"):
        rowwise_kernels().argmax(half)
