"""bf16_matmul.c: the documented sum order, the portable build's bits at every level whose
products run on VDPBF16PS, the AMX tiles' wiring and accuracy, and a row's bits whatever rows come
with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.bf16_matmul import Bf16Kernels, bf16_kernels, pack
from deepinfer.model.layers.bf16_linear import Bf16Linear, use_bf16_kernels_

BF16_LEVELS = [
    name for name in (level.name for level in isa.machine_levels()) if name in ("avx512_bf16", "amx")
]
SHAPES = [(1, 576, 576), (3, 7, 50), (5, 1536, 576), (33, 37, 1536), (70, 9, 64), (2, 5, 31)]


def kernels(level: str) -> Bf16Kernels:
    built = bf16_kernels(isa.compiler_flags(level))
    assert built is not None, "no C compiler"
    return built


def on_tiles(level: str) -> bool:
    """Whether this level's products with K a multiple of 32 run on AMX tiles, whose sums are the
    hardware's own (not the documented VDPBF16PS order)."""
    return kernels(level).amx_status == 1


VECTOR_LEVELS = [level for level in BF16_LEVELS if not on_tiles(level)]
TILE_LEVELS = [level for level in BF16_LEVELS if on_tiles(level)]


def operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).bfloat16()
    w = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
    return x, w, torch.randn(n, generator=generator)


def linear(built: Bf16Kernels, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return built.linear(x, pack(w), w.shape[0], bias)


def documented(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The header's numerics written out in numpy float32, every output at once: one sum over the
    input pairs in order (the odd input of each pair first), the bias added, rounded to bf16."""
    f32 = np.float32
    xs, ws = x.float().numpy(), w.float().numpy()
    if xs.shape[1] % 2:
        xs, ws = np.pad(xs, ((0, 0), (0, 1))), np.pad(ws, ((0, 0), (0, 1)))
    acc = np.zeros((xs.shape[0], ws.shape[0]), dtype=f32)
    for q in range(0, xs.shape[1], 2):
        acc = acc + xs[:, q + 1 : q + 2] * ws[None, :, q + 1]
        acc = acc + xs[:, q : q + 1] * ws[None, :, q]
    if bias is not None:
        acc = acc + bias.numpy().astype(f32)[None, :]
    return torch.from_numpy(acc).bfloat16()  # torch rounds fp32 to bf16 to nearest even


@pytest.mark.parametrize("level", ["portable", *BF16_LEVELS])
def test_the_kernel_sums_in_the_documented_order(level: str) -> None:
    # K = 70 and 17 are not multiples of 32: the vector path, on tiles' levels too.
    for m, n, k in [(2, 3, 70), (1, 5, 64), (3, 4, 17)]:
        x, w, bias = operands(m, n, k, seed=k)
        for b in (bias, None):
            assert torch.equal(linear(kernels(level), x, w, b), documented(x, w, b)), (m, n, k, b is None)


@pytest.mark.parametrize("level", VECTOR_LEVELS)
def test_every_vector_level_has_the_portable_bits(level: str) -> None:
    portable, vector = kernels("portable"), kernels(level)
    for m, n, k in SHAPES:
        x, w, bias = operands(m, n, k)
        for b in (bias, None):
            assert torch.equal(linear(vector, x, w, b), linear(portable, x, w, b)), (m, n, k)


def test_a_cpu_with_amx_bf16_runs_the_tiles() -> None:
    if "amx" not in BF16_LEVELS:
        pytest.skip("this CPU has no AMX")
    assert kernels("amx").amx_status == 1, "the OS refused the tiles or their self-check failed"


@pytest.mark.parametrize("level", TILE_LEVELS)
def test_tiles_give_exact_sums_the_vector_paths_bits(level: str) -> None:
    """Small integers make every sum exact, so the tiles and the vector path must agree bit for bit:
    this checks how the tiles read the rows and the packed panels (row tiles of every height, the
    padded last block, a partial last panel), whatever the order of their sums."""
    generator = torch.Generator().manual_seed(3)
    for m, n, k in [(1, 48, 64), (9, 200, 576), (16, 37, 1536), (45, 200, 576), (70, 33, 96)]:
        x = torch.randint(-8, 8, (m, k), generator=generator).bfloat16()
        w = torch.randint(-8, 8, (n, k), generator=generator).bfloat16()
        bias = torch.randint(-64, 64, (n,), generator=generator).float()
        for b in (bias, None):
            assert torch.equal(linear(kernels(level), x, w, b), linear(kernels("portable"), x, w, b)), (
                m,
                n,
                k,
            )


@pytest.mark.parametrize("level", ["portable", *BF16_LEVELS])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(level: str) -> None:
    built = kernels(level)
    x, w, bias = operands(70, 200, 576)
    together = linear(built, x, w, bias)
    for i in (0, 3, 33, 64, 69):
        assert torch.equal(linear(built, x[i : i + 1], w, bias), together[i : i + 1]), i
    for start, stop in ((1, 5), (4, 69), (10, 70)):
        assert torch.equal(linear(built, x[start:stop], w, bias), together[start:stop]), (start, stop)
    # Rows taken out of a wider tensor (a column slice: strided rows) read the same values.
    wide = torch.cat([x, torch.randn(70, 13).bfloat16()], dim=1)
    assert torch.equal(linear(built, wide[:, :576], w, bias), together)


@pytest.mark.parametrize("level", ["portable", *BF16_LEVELS])
def test_the_kernel_is_a_bf16_product(level: str) -> None:
    """Against the product in float64 on the same bf16 values: one bf16 rounding of the result
    (half of bf16's epsilon) plus an fp32 sum of K terms (the tiles' sums included)."""
    for m, n, k in SHAPES:
        x, w, bias = operands(m, n, k, seed=1)
        exact = x.double() @ w.double().T + bias.double()
        ours = linear(kernels(level), x, w, bias).double()
        scale = (x.double().abs() @ w.double().abs().T + bias.double().abs()).max().item()
        eps = torch.finfo(torch.bfloat16).eps
        assert (ours - exact).abs().max().item() <= eps / 2 * exact.abs().max().item() + k * 2**-24 * scale


def test_packing_places_each_weight_in_its_panel() -> None:
    w = torch.arange(5 * 35, dtype=torch.float32).view(35, 5).bfloat16()  # N = 35, K = 5: both padded
    packed = pack(w)
    assert packed.shape == (3, 3, 16, 2)
    for n, k in ((0, 0), (17, 3), (34, 4), (16, 1)):
        assert packed[n // 16, k // 2, n % 16, k % 2] == w[n, k]
    assert not packed[2, :, 3:].any() and not packed[:, 2, :, 1].any()  # past N, past K


def test_a_packed_weight_of_another_shape_is_refused() -> None:
    built = kernels("portable")
    with pytest.raises(ValueError, match="not one of"):
        built.linear(torch.zeros(2, 64).bfloat16(), pack(torch.zeros(8, 66).bfloat16()), 8)


def test_bf16_linear_layers_replace_torch_linears() -> None:
    built = kernels(isa.machine_levels()[-1].name if BF16_LEVELS else "portable")
    net = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=True), torch.nn.Linear(32, 8)).bfloat16()
    net.append(torch.nn.Linear(8, 4))  # fp32: the kernel does not take it
    weight, bias = net[0].weight, net[0].bias
    assert use_bf16_kernels_(net, built) == 2
    assert isinstance(net[0], Bf16Linear) and isinstance(net[1], Bf16Linear)
    assert isinstance(net[2], torch.nn.Linear)
    assert net[0].bias.dtype is torch.float32
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(net[0](x), linear(built, x, weight, bias.float()))
