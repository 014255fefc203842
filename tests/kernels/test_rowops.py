"""rowops.h (the row arithmetic the GGUF products' prologues share) against its formula in numpy."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.rowwise import rowwise_kernels

PROBE = Path(__file__).with_name("rowops_probe.c")


def _swiglu_formula(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up as rowops.h writes it, one float32 rounding per operation (the kernels are
    built without contraction): e^x clamped to [-87, 88] as 2^n times a degree-6 polynomial of 2^f."""
    f32 = np.float32
    x = -gate
    x = np.where(x < f32(-87.0), f32(-87.0), np.where(x > f32(88.0), f32(88.0), x))
    t = x * f32(1.44269504088896341)
    n = np.floor(t)
    f = t - n
    p = f32(1.535336188319500e-4)
    for c in (1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2, 2.402264791363012e-1):
        p = p * f + f32(c)
    p = (p * f + f32(6.931472028550421e-1)) * f + f32(1.0)
    e = (p.view(np.int32) + n.astype(np.int32) * np.int32(1 << 23)).view(np.float32)
    return gate / (f32(1.0) + e) * up


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_swiglu_is_its_formula_bit_for_bit_at_every_level(level: isa.Level, tmp_path: Path) -> None:
    """SwiGLU runs 16 lanes at a time (GCC vectors: one AVX-512 register, two AVX2 ones or four
    SSE ones) and the rest one by one: every value is the scalar formula's to the bit, from deep
    in the clamped tails to values near 0, whatever the level the kernels are built for."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    assert compiler, "the kernels need a C compiler on the test machine"
    library = tmp_path / f"rowops-{level.name}.so"
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off", *level.compiler_flags]
    subprocess.run([compiler, *flags, str(PROBE), "-o", str(library), "-lm"], check=True)
    probe = ctypes.CDLL(str(library)).probe_swiglu
    probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    rng = np.random.default_rng(3)
    dim = 4099  # 256 vectors of 16 and a tail of 3
    gate = np.concatenate(
        [rng.uniform(-120.0, 120.0, dim), rng.standard_normal(dim) * 4.0, rng.standard_normal(dim) * 1e-3]
    ).astype(np.float32)
    up = rng.standard_normal(gate.size).astype(np.float32)
    out = np.empty_like(gate)
    probe(gate.ctypes.data, up.ctypes.data, out.ctypes.data, gate.size)
    want = _swiglu_formula(gate, up)
    assert np.array_equal(out.view(np.int32), want.view(np.int32)), np.flatnonzero(out != want)[:5]


def _rms_norm_formula(v: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rowops.h's RMSNorm of rows v: each square in float32, summed in float64 in index order (a
    cumulative sum is sequential), the mean and the scale in float32."""
    f32 = np.float32
    squares = np.cumsum((v * v).astype(np.float64), axis=-1)[..., -1]
    mean = (squares / v.shape[-1]).astype(np.float32)
    scale = f32(1.0) / np.sqrt(mean + f32(eps))
    return (v * scale[..., None]) * weight


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_rms_norm_is_its_formula_bit_for_bit_at_every_level(level: isa.Level) -> None:
    """Rows are normalized eight at a time, their sums of squares side by side: every row keeps its
    own sequential sum, so its bits are the formula's alone or in any group (13 rows: a group of 8
    and one of 5), with and without the residual add, rows of very different scales together."""
    kernels = rowwise_kernels(level.compiler_flags)
    assert kernels is not None
    rng = np.random.default_rng(11)
    dim = 577
    x = (rng.standard_normal((13, dim)) * np.exp(rng.uniform(-9.0, 9.0, (13, 1)))).astype(np.float32)
    residual = rng.standard_normal((13, dim)).astype(np.float32)
    weight = rng.standard_normal(dim).astype(np.float32)
    w = torch.from_numpy(weight)
    out, none = kernels.rms_norm(torch.from_numpy(x), w, 1e-5)
    assert none is None and np.array_equal(out.numpy(), _rms_norm_formula(x, weight, 1e-5))
    out, summed = kernels.rms_norm(torch.from_numpy(x), w, 1e-5, torch.from_numpy(residual))
    assert np.array_equal(summed.numpy(), x + residual)
    assert np.array_equal(out.numpy(), _rms_norm_formula(x + residual, weight, 1e-5))
    alone = [kernels.rms_norm(torch.from_numpy(x[i : i + 1]), w, 1e-5)[0] for i in range(13)]
    assert torch.equal(torch.cat(alone), kernels.rms_norm(torch.from_numpy(x), w, 1e-5)[0])


@pytest.mark.parametrize("level", isa.machine_levels(), ids=lambda level: level.name)
def test_bf16_swiglu_is_the_formula_rounded_once(level: isa.Level) -> None:
    """A bf16 model's SwiGLU (rowwise.c, and bf16_layers.c through the same row function): gate and
    up widened, the fp32 formula, one rounding to nearest even, as torch's .to(torch.bfloat16)."""
    kernels = rowwise_kernels(level.compiler_flags)
    assert kernels is not None
    rng = np.random.default_rng(5)
    dim = 1030  # 16 chunks of 64 and a tail of 6
    gate_up = torch.from_numpy((rng.standard_normal((3, 2 * dim)) * 6.0).astype(np.float32)).to(
        torch.bfloat16
    )
    wide = gate_up.float().numpy()
    want = torch.from_numpy(_swiglu_formula(wide[:, :dim], wide[:, dim:])).to(torch.bfloat16)
    assert torch.equal(kernels.swiglu_bf16(gate_up).view(torch.int16), want.view(torch.int16))
    strided = torch.cat([gate_up, gate_up[:, :2]], dim=1)[:, : 2 * dim]  # rows 2 * dim + 2 apart
    assert torch.equal(kernels.swiglu_bf16(strided).view(torch.int16), want.view(torch.int16))
