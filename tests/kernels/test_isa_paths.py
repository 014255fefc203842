"""Every instruction-set path this CPU has, against the portable C path (kernels/isa.py).

The project lands on AMD Zen (AVX-512 VNNI/BF16), Intel Xeon (AMX) and AVX2-only machines; each
kernel family is built here at every level the CPU runs (`DEEPINFER_CPU_ISA`, as a user would
force it) and compared with the portable build: bit for bit where the code claims it (the integer
GGUF products, the row kernels), within fp32 rounding where a vector path sums in another order
(the attention's 16-lane exp and sums), and the attention's AVX2 and AVX-512 builds against
each other bit for bit; tests/engine/test_attention_backends.py checks the attention's batch
invariance at every level."""

from __future__ import annotations

import pytest
import torch

from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.kernels import isa
from deepinfer.kernels.gguf_blocks import gguf_kernels
from deepinfer.kernels.rowwise import rowwise_kernels
from tests.engine.fused_steps import record_both_paths
from tests.engine.test_attention_backends import BLOCK, HEAD_DIM, HEADS, KV_DTYPES, KV_HEADS, _step, tolerance

LEVELS = [level.name for level in isa.machine_levels()]
VECTOR_LEVELS = LEVELS[1:]


def test_the_levels_follow_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = isa.cpu_flags()
    assert LEVELS[0] == "portable"
    if isa.is_x86():
        for level in isa.X86_LEVELS:
            assert (level.name in LEVELS) == (level.cpu_flags <= flags), level.name
        # The levels are nested: each one's flags include the previous one's.
        for lower, higher in zip(isa.X86_LEVELS, isa.X86_LEVELS[1:]):
            assert lower.cpu_flags < higher.cpu_flags
            assert higher.compiler_flags[: len(lower.compiler_flags)] == lower.compiler_flags
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.selected_level() == "native"
    if isa.is_x86():  # the best level's own flags: the same code on every CPU of that level
        assert isa.compiler_flags() == (*isa.machine_levels()[-1].compiler_flags, "-mtune=native")
    assert isa.describe() == f"{LEVELS[-1]} (native)"
    monkeypatch.setenv(isa.ENV, " Portable ")
    assert isa.selected_level() == "portable" and isa.describe() == "portable"


def test_a_level_this_cpu_lacks_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.ENV, "avx1024")
    with pytest.raises(ValueError, match=r"DEEPINFER_CPU_ISA='avx1024': this CPU runs .*portable"):
        isa.compiler_flags()
    missing = [level.name for level in isa.X86_LEVELS if level.name not in LEVELS]
    if isa.is_x86() and missing:
        monkeypatch.setenv(isa.ENV, missing[0])
        with pytest.raises(ValueError, match=missing[0]):
            isa.selected_level()


def _paged_backend(monkeypatch: pytest.MonkeyPatch, level: str) -> CpuPagedBackend:
    monkeypatch.setenv(isa.ENV, level)
    return CpuPagedBackend()


def _mixed_step(backend: CpuPagedBackend, kv_dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """Decodes, kernel-row chunks and a tiled prefill chunk in one call, seeded: the same inputs
    for every backend."""
    query_lens, seq_lens = [1, 1, 1, 6, 40], [5, 300, 1000, 90, 200]  # decodes first, as the runner lays rows
    generator = torch.Generator().manual_seed(7)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 8
    cache = torch.randn(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype)
    if window is not None:
        cache[:BLOCK] = float("nan")  # blocks outside the window point here: reading one poisons the row
    tokens = sum(query_lens)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
    meta = _step(query_lens, seq_lens, num_blocks, seed=1, window=window)
    backend.prepare(meta)
    return backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)


@pytest.mark.parametrize("level", VECTOR_LEVELS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_at_every_level_agrees_with_the_portable_build(
    monkeypatch: pytest.MonkeyPatch, level: str, kv_dtype: torch.dtype, window: int | None
) -> None:
    """The vector paths sum the softmax in another order (16 lanes, a polynomial exp on 16 lanes):
    fp32 rounding apart, never a different answer (bf16 rounding apart on AMX tiles); the
    portable build itself is checked against the PyTorch reference in
    tests/engine/test_attention_backends.py."""
    portable = _mixed_step(_paged_backend(monkeypatch, "portable"), kv_dtype, window)
    backend = _paged_backend(monkeypatch, level)
    vector = _mixed_step(backend, kv_dtype, window)
    assert torch.isfinite(vector).all()
    torch.testing.assert_close(vector, portable, **tolerance(backend, kv_dtype))


@pytest.mark.parametrize("level", [name for name in VECTOR_LEVELS if name != "avx2"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 37])
def test_paged_attention_has_the_avx2_bits_at_every_higher_level(
    monkeypatch: pytest.MonkeyPatch, level: str, kv_dtype: torch.dtype, window: int | None
) -> None:
    """The fp32-arithmetic attention writes each fused multiply-add out and is built without
    contraction (so the compiler cannot fuse a product into a sum one way in one function and the
    other way in another): its AVX2 and AVX-512 builds run the same operations lane by lane and
    give the same bits, which is what keeps the default model's greedy output the same on AVX2,
    Zen 4 and Xeon machines. A bf16 cache on bf16 products (VDPBF16PS, AMX) rounds otherwise and
    is left out."""
    backend = _paged_backend(monkeypatch, level)
    if kv_dtype == torch.bfloat16 and backend.bf16_path:
        pytest.skip("a bf16 cache runs on bf16 products at this level")
    vector = _mixed_step(backend, kv_dtype, window)
    avx2 = _mixed_step(_paged_backend(monkeypatch, "avx2"), kv_dtype, window)
    assert torch.isfinite(vector).all()
    assert torch.equal(vector, avx2)


@pytest.mark.parametrize("level", VECTOR_LEVELS)
def test_the_row_kernels_at_every_level_have_the_portable_bits(level: str) -> None:
    """rowwise.c is built with -ffp-contract=off and sums each row in a fixed order: RMSNorm (with
    the residual add) and rotary give the same bits at every level."""
    portable = rowwise_kernels(isa.compiler_flags("portable"))
    vector = rowwise_kernels(isa.compiler_flags(level))
    assert portable is not None and vector is not None
    generator = torch.Generator().manual_seed(3)
    for dim in (576, 64, 40):
        x, residual = torch.randn(2, 7, dim, generator=generator), torch.randn(2, 7, dim, generator=generator)
        weight = torch.randn(dim, generator=generator)
        for res in (None, residual):
            a, b = portable.rms_norm(x, weight, 1e-5, res), vector.rms_norm(x, weight, 1e-5, res)
            assert torch.equal(a[0], b[0]) and (res is None or torch.equal(a[1], b[1])), (dim, res is None)
    positions = torch.tensor([0, 5, 17, 511], dtype=torch.int64)
    angles = torch.arange(512, dtype=torch.float32)[:, None] * torch.rand(1, 32, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = []
    for kernels in (portable, vector):
        x = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(9))
        kernels.rotary_(x, positions, cos.contiguous(), sin.contiguous())
        rotated.append(x)
    assert torch.equal(rotated[0], rotated[1])


# Levels whose flags change what these tests' C sources compile (bf16's own kernel,
# bf16_matmul.c, is checked level by level in test_bf16_matmul.py; AMX adds no kernel code yet).
CODE_PATH_LEVELS = [name for name in LEVELS if name in ("portable", "avx2", "avx512", "avx512_vnni")]
PROMPTS = ["The capital of France is", "One, two, three,"]


@pytest.fixture(scope="module")
def greedy_by_level() -> dict[str, list[list[int]]]:
    return {}


@pytest.mark.parametrize("level", CODE_PATH_LEVELS)
def test_the_default_model_at_every_level(
    monkeypatch: pytest.MonkeyPatch, level: str, greedy_by_level: dict[str, list[list[int]]]
) -> None:
    """The default model built at each level: the GGUF kernels report that level's dot products,
    every step runs all layers in one C call (decode_layers.c, which includes gguf_matmul.c and
    calls the row and attention kernels of the same level) with the layer-by-layer path's bits,
    and the greedy continuations are those of the portable build."""
    from deepinfer import LLM, SamplingParams

    monkeypatch.setenv(isa.ENV, level)
    llm = LLM(kv_cache_memory=32 << 20)
    assert gguf_kernels().simd_level == {"portable": 0, "avx2": 1, "avx512": 1}.get(level, 2)
    steps = record_both_paths(llm.engine.core.runner, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert steps and all(fused and same for _, fused, same in steps), steps
    greedy_by_level[level] = [o.outputs[0].token_ids for o in outputs]
    # The portable level runs first (parametrize order); run alone, a level has nothing to compare.
    assert greedy_by_level[level] == greedy_by_level.get("portable", greedy_by_level[level])
