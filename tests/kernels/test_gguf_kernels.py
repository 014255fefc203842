"""The GGUF block kernels against the `gguf` package's dequantization and a float64 reference."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from deepinfer.kernels import isa
from deepinfer.kernels.gguf_blocks import (
    INTERLEAVED_TYPES,
    GGUFKernels,
    PackedGroup,
    PackedMatrix,
    gguf_kernels,
)
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.loader.gguf_tensors import read_tensors
from tests.kernels.gguf_testing import (
    FORMATS,
    activation_error_bound,
    dequantized,
    random_packed,
    reference_product,
)

ROWS, COLS = 70, 512  # 70: tiles of 4 and 2 rows with remainders; 512: two k-quant superblocks


@pytest.fixture(scope="module")
def kernels() -> GGUFKernels:
    built = gguf_kernels()
    assert built is not None, "the kernels must build on the test machine"
    return built


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _matmul(
    kernels: GGUFKernels, x: np.ndarray, *matrices: PackedMatrix, portable: bool = False
) -> np.ndarray:
    return kernels.matmul(torch.from_numpy(x), PackedGroup(matrices), portable=portable).numpy()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("batch", [1, 9])
def test_kernel_equals_the_quantized_activation_reference(kernels, name, batch):
    """Exact integer block dots: only float32 rounding separates the kernel from float64 math."""
    rng = _rng(name, batch)
    matrix = random_packed(name, ROWS, COLS, rng)
    x = rng.standard_normal((batch, COLS)).astype(np.float32)
    reference, magnitude = reference_product(x, matrix)
    error = np.abs(_matmul(kernels, x, matrix) - reference)
    assert np.all(error <= 1e-5 * magnitude + 1e-7), (error / magnitude).max()


@pytest.mark.parametrize("name", FORMATS)
def test_kernel_error_against_fp32_matmul_is_bounded_by_activation_rounding(kernels, name):
    """Against dequantize-then-matmul: at most half an activation step per value, times |w|."""
    rng = _rng("bound", name)
    matrix = random_packed(name, ROWS, COLS, rng)
    x = rng.standard_normal((9, COLS)).astype(np.float32)
    exact = x.astype(np.float64) @ dequantized(matrix).astype(np.float64).T
    _, magnitude = reference_product(x, matrix)
    error = np.abs(_matmul(kernels, x, matrix) - exact)
    assert np.all(error <= activation_error_bound(x, matrix) + 1e-5 * magnitude)
    # and in practice far below the bound: rounding errors cancel
    assert np.linalg.norm(error) / np.linalg.norm(exact) < 0.02


@pytest.mark.parametrize("name", FORMATS)
def test_a_row_never_depends_on_batch_threads_or_code_path(kernels, name):
    rng = _rng("invariance", name)
    matrices = (random_packed(name, ROWS, COLS, rng), random_packed("Q8_0", 30, COLS, rng))
    x = rng.standard_normal((33, COLS)).astype(np.float32)
    batched = _matmul(kernels, x, *matrices)
    alone = np.concatenate([_matmul(kernels, x[i : i + 1], *matrices) for i in range(len(x))])
    assert np.array_equal(batched, alone)
    spiked = x.copy()
    spiked[0] *= 1000  # an outlier in another row changes nothing in this one
    assert np.array_equal(_matmul(kernels, spiked, *matrices)[1:], batched[1:])
    assert np.array_equal(_matmul(kernels, x, *matrices, portable=True), batched)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _matmul(kernels, x, *matrices)
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(one_thread, batched)


def test_a_group_computes_as_the_concatenation_of_its_matrices(kernels):
    rng = _rng("group")
    parts = [
        random_packed(name, rows, COLS, rng)
        for name, rows in (
            ("Q4_K", 48),
            ("Q6_K", 17),
            ("Q4_1", 31),
            ("Q5_K", 9),
            ("Q3_K", 16),
            ("Q5_0", 8),
            ("Q5_1", 3),
        )
    ]
    x = rng.standard_normal((5, COLS)).astype(np.float32)
    together = _matmul(kernels, x, *parts)
    assert np.array_equal(together, np.concatenate([_matmul(kernels, x, p) for p in parts], axis=1))


@pytest.mark.parametrize("name", FORMATS)
def test_row_lookup_equals_the_gguf_package(kernels, name):
    rng = _rng("rows", name)
    matrix = random_packed(name, ROWS, COLS, rng)
    ids = torch.tensor([5, 0, 69, 5, 33])
    assert np.array_equal(kernels.dequantize_rows(matrix, ids).numpy(), dequantized(matrix)[ids.numpy()])


@pytest.mark.parametrize("name", FORMATS)
def test_interleaved_rows_give_the_same_bits(kernels, name):
    """The 32-wide formats with every eight rows interleaved (what the engine computes on): the
    same products bit for bit, at every batch size, on the SIMD and the portable path (with AVX-512
    VNNI, batches > 1 take two 8-row groups per tile and the last of the 72 rows one), and the same
    row lookups; formats and row counts without an interleaved form are left as they are."""
    rng = _rng("interleaved", name)
    matrix = random_packed(name, 72, COLS, rng)
    interleaved = kernels.interleave(matrix)
    if f"{name}_X8" not in INTERLEAVED_TYPES:
        assert interleaved is matrix
        return
    assert interleaved.qtype != matrix.qtype and interleaved.data.shape == matrix.data.shape
    assert not np.array_equal(interleaved.data, matrix.data)
    assert kernels.interleave(random_packed(name, 70, COLS, rng)).qtype == matrix.qtype  # 70 % 8
    q8 = random_packed("Q8_0", 30, COLS, rng)  # a segment beside it in the file's layout
    for batch in (1, 3, 4, 5, 13, 33):  # 13: a tile of 8 rows (Q3_K, Q4_K, Q6_K), of 4 and of 1
        x = rng.standard_normal((batch, COLS)).astype(np.float32)
        expected = _matmul(kernels, x, matrix, q8)
        assert np.array_equal(_matmul(kernels, x, interleaved, q8), expected), batch
        assert np.array_equal(_matmul(kernels, x, interleaved, q8, portable=True), expected), batch
    ids = torch.tensor([5, 0, 71, 8, 33])
    assert np.array_equal(kernels.dequantize_rows(interleaved, ids).numpy(), dequantized(matrix)[ids.numpy()])


def _other_targets() -> dict[str, tuple[tuple[str, ...], int]]:
    """Every instruction-set level this CPU runs (kernels/isa.py): its flags and the simd level the
    library reports. AVX-512 without VNNI keeps the AVX2 dot products; bf16 adds nothing to these
    kernels, AMX its tiles (test_amx_tiles_give_the_vector_paths_bits)."""
    simd = {"portable": 0, "avx2": 1, "avx512": 1}
    return {level.name: (level.compiler_flags, simd.get(level.name, 2)) for level in isa.machine_levels()}


@pytest.mark.parametrize("target", _other_targets().values(), ids=_other_targets().keys())
def test_every_instruction_set_gives_the_same_bits(kernels, target):
    flags, level = target
    other = gguf_kernels(flags)
    assert other is not None and other.simd_level == level
    for name in FORMATS:
        rng = _rng("isa", name)
        matrix = random_packed(name, 72, COLS, rng)
        for layout in (matrix, kernels.interleave(matrix)):
            for batch in (1, 6):
                x = rng.standard_normal((batch, COLS)).astype(np.float32)
                assert np.array_equal(_matmul(other, x, layout), _matmul(kernels, x, matrix)), (name, batch)


def _tile_builds(kernels: GGUFKernels) -> list[GGUFKernels]:
    """The builds that put products on AMX tiles here: this CPU's own where it has AMX, and one
    with the tile instructions done in C from their definitions (GGUF_AMX_EMULATE), which runs the
    tile code on any machine with the vector path."""
    if kernels.simd_level == 0:
        pytest.skip("no vector path on this CPU, so no tile path either")
    vector = next(level for level in isa.machine_levels() if level.name == "avx2").compiler_flags
    emulated = gguf_kernels((*vector, "-DGGUF_AMX_EMULATE"))
    assert emulated is not None and emulated.amx_status == 1, "the emulated tiles failed their self-check"
    if {"amx_tile", "amx_int8"} <= isa.cpu_flags() and isa.selected_level() == isa.NATIVE:
        assert kernels.amx_status in (1, -1), "AMX tiles disagreed with the VNNI path"
        return [emulated, kernels] if kernels.amx_status == 1 else [emulated]
    assert kernels.amx_status == 0
    return [emulated]


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_amx_tiles_give_the_vector_paths_bits(kernels, name):
    """16-row tiles (pairs of them, a remainder on the vector path, an 8-row last unit) and the
    fused RMSNorm prologue: every bit as the vector and portable paths. The k-quants take one
    product per sub-block (32 or 16 positions) and the VNNI kernels' integer steps."""
    rng = _rng("amx", name)
    matrix = kernels.interleave(random_packed(name, 40, COLS, rng))  # units of 16, 16 and 8 rows
    q8 = random_packed("Q8_0", 8, COLS, rng)  # a segment in the file's layout beside it
    group = PackedGroup([matrix, q8])
    norm = torch.from_numpy(rng.standard_normal(COLS).astype(np.float32))
    for built in _tile_builds(kernels):
        for batch in (15, 16, 37, 48, 70):
            x = torch.from_numpy(rng.standard_normal((batch, COLS)).astype(np.float32))
            vector = kernels.matmul(x, group, tiles=False)
            assert torch.equal(built.matmul(x, group), vector), (batch, built.amx_status)
            assert torch.equal(built.matmul(x, group, portable=True), vector), batch
            assert torch.equal(built.matmul(x[5:6], group), vector[5:6]), batch
            fused, _ = built.matmul_rms_norm(x, None, norm, 1e-5, group)
            assert torch.equal(fused, kernels.matmul_rms_norm(x, None, norm, 1e-5, group, portable=True)[0])


def test_the_real_model_tensors(kernels, default_model_path):
    """The default model's Q4_1 projections and Q8_0 embedding, against dequantize-then-matmul."""
    tensors = {t.name: t for t in read_tensors(default_model_path)}
    rng = _rng("real")
    for name in ("blk.0.attn_q.weight", "blk.17.ffn_down.weight", "token_embd.weight"):
        tensor = tensors[name]
        blocks = tensor.data[:2048]  # rows of the memory map, not a copy
        matrix = PackedMatrix(int(tensor.tensor_type), blocks.shape[0], tensor.shape[0], blocks)
        x = rng.standard_normal((4, matrix.cols)).astype(np.float32)
        exact = x.astype(np.float64) @ dequantized(matrix).astype(np.float64).T
        reference, magnitude = reference_product(x, matrix)
        y = _matmul(kernels, x, matrix)
        assert np.all(np.abs(y - reference) <= 1e-5 * magnitude + 1e-7), name
        assert np.all(np.abs(y - exact) <= activation_error_bound(x, matrix) + 1e-5 * magnitude), name
        assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < 0.01, name


def test_bad_inputs_are_refused(kernels):
    rng = _rng("bad")
    matrix = random_packed("Q4_0", 8, 64, rng)
    group = PackedGroup([matrix])
    with pytest.raises(ValueError, match="float32"):
        kernels.matmul(torch.zeros(2, 64, dtype=torch.float64), group)
    with pytest.raises(ValueError, match="float32"):
        kernels.matmul(torch.zeros(2, 32), group)
    with pytest.raises(IndexError):
        kernels.dequantize_rows(matrix, torch.tensor([8]))
    with pytest.raises(ValueError, match="same number of columns"):
        PackedGroup([matrix, random_packed("Q4_0", 8, 96, rng)])
    with pytest.raises(ValueError, match="blocks"):
        kernels.row_bytes(2, 48)


def test_fused_prologues_equal_the_separate_steps(kernels):
    """RMSNorm (with the residual add) and SwiGLU inside the activation pass, as a layer uses them; 13
    rows: a group of 8 whose sums of squares advance side by side, and 5 more."""
    rng = _rng("prologues")
    norm = RMSNorm(COLS, 1e-5)
    norm.weight.data = torch.from_numpy(rng.standard_normal(COLS).astype(np.float32))
    group = PackedGroup([random_packed("Q4_1", 40, COLS, rng), random_packed("Q4_K", 24, COLS, rng)])
    x, residual = (torch.from_numpy(rng.standard_normal((13, COLS)).astype(np.float32)) for _ in range(2))
    y, summed = kernels.matmul_rms_norm(x, residual, norm.weight, norm.eps, group)
    assert torch.equal(summed, x + residual)
    assert torch.equal(y, kernels.matmul(norm(x + residual), group))  # the same row math, same bits
    first, same = kernels.matmul_rms_norm(x, None, norm.weight, norm.eps, group)
    assert same is x and torch.equal(first, kernels.matmul(norm(x), group))
    gate_up = torch.from_numpy(rng.standard_normal((13, 2 * COLS)).astype(np.float32))
    fused = kernels.matmul_swiglu(gate_up, group)
    gate, up = gate_up.split(COLS, dim=-1)
    separate = kernels.matmul(torch.nn.functional.silu(gate) * up, group)
    assert torch.allclose(fused, separate, rtol=1e-3, atol=1e-3 * separate.abs().max().item())
    for run in (
        lambda rows, portable: kernels.matmul_rms_norm(
            x[rows], residual[rows], norm.weight, norm.eps, group, portable
        )[0],
        lambda rows, portable: kernels.matmul_swiglu(gate_up[rows], group, portable),
    ):
        batched = run(slice(None), False)
        assert torch.equal(run(slice(None), True), batched)
        assert torch.equal(torch.cat([run(slice(i, i + 1), False) for i in range(13)]), batched)
