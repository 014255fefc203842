"""The C kernel backend against the PyTorch reference on one mixed step: decodes, short chunks
that run as kernel rows (speculative verification) and long prefill chunks that go through tiled
GEMMs; with an fp32, an fp16 and a bf16 KV cache (the reference reads the same values, so they
still agree: to fp32 rounding, or on AMX tiles to bf16's, see `tolerance`)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.attention.backend import TorchReferenceBackend
from deepinfer.attention.cpu_paged import KERNEL_CHUNK_TOKENS, CpuPagedBackend
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.kernels import isa

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tolerance(backend: CpuPagedBackend, kv_dtype: torch.dtype, head_dim: int = HEAD_DIM) -> dict[str, float]:
    """How far the kernel's outputs may be from an fp32 softmax of the same cache values: a few
    fp32 ulps of each output per term; on bf16 products (AMX tiles or VDPBF16PS: a bf16 cache,
    head_dim 64 or 128) q and the softmax weights are rounded to bf16 (2^-9 relative each) before
    their products."""
    bf16 = kv_dtype is torch.bfloat16 and backend.bf16_path > 0 and head_dim in (64, 128)
    return {"atol": 1e-2, "rtol": 1e-2} if bf16 else {"atol": 2e-5, "rtol": 1e-4}


def _step(
    query_lens: list[int],
    seq_lens: list[int],
    num_blocks: int,
    seed: int,
    window: int | None = None,
    block: int = BLOCK,
) -> AttentionMetadata:
    """Sequences with scattered block tables; the step's new tokens are the last query_len of each.
    With a window, blocks no query of the step sees point at block 0, which holds NaNs: reading
    one would poison the output."""
    rng = random.Random(seed)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for num_q, length in zip(query_lens, seq_lens, strict=True):
        table = [free.pop() for _ in range(-(-length // block))]
        if window is not None:
            first_key = max(length - num_q - window + 1, 0)
            table[: first_key // block] = [0] * (first_key // block)
        tables.append(table)
        slots.extend(table[p // block] * block + p % block for p in range(length - num_q, length))
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block,
        window=window,
    )


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1, 1, 1], [5, 40, 129]),  # decodes only
        ([1, 6, 3, KERNEL_CHUNK_TOKENS], [70, 300, 17, 16]),  # verification chunks: kernel rows, contiguous
        ([1, 1, 64, 6, 40, 2], [33, 200, 64, 90, 500, 2]),  # long chunks between short ones: gathered rows
        ([KERNEL_CHUNK_TOKENS + 1], [KERNEL_CHUNK_TOKENS + 30]),  # just over the threshold: tiled GEMMs
        ([1, 300, 200], [50, 800, 200]),  # chunks longer than a query tile, after a prefix and from 0
        ([1] * 6, [127, 128, 129, 256, 700, 1000]),  # decode contexts of one part and of several
    ],
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 37, 200])
def test_cpu_kernel_matches_reference(
    query_lens: list[int], seq_lens: list[int], kv_dtype: torch.dtype, window: int | None
) -> None:
    try:
        fast = CpuPagedBackend()
    except RuntimeError as exc:
        pytest.fail(f"the C kernel must build on the machines we support: {exc}")
    reference = TorchReferenceBackend()
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 8
    cache = torch.randn(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM).to(kv_dtype)
    if window is not None:
        cache[:BLOCK] = float("nan")
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM)
    outputs = []
    for backend in (fast, reference):
        meta = _step(query_lens, seq_lens, num_blocks, seed=1, window=window)
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, cache.clone(), meta, HEAD_DIM**-0.5))
    torch.testing.assert_close(outputs[0], outputs[1], **tolerance(fast, kv_dtype))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (8, 1, 64),  # two tiles of four query heads per key row
        (12, 2, 128),  # tiles of two (the accumulators of 128-wide heads)
        (5, 1, 80),  # a head_dim of whole vectors but no specialization: tiles of 2, 2, 1
        (4, 2, 40),  # not whole vectors: the scalar loops
    ],
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_decode_kernel_matches_reference_for_other_head_shapes(
    heads: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype
) -> None:
    query_lens, seq_lens = [1, 1, 1], [9, 130, 300]
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 8
    cache = torch.randn(num_blocks * BLOCK, 2, kv_heads, head_dim).to(kv_dtype)
    q = torch.randn(3, heads, head_dim)
    k, v = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    outputs = []
    fast = CpuPagedBackend()
    for backend in (fast, TorchReferenceBackend()):
        meta = _step(query_lens, seq_lens, num_blocks, seed=1)
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outputs[0], outputs[1], **tolerance(fast, kv_dtype, head_dim))


@pytest.mark.parametrize("block", [5, 48, 256])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_any_block_size_matches_reference(block: int, head_dim: int, kv_dtype: torch.dtype) -> None:
    """The kernel steps through spans of aligned positions (64 of them for head_dim 64, 32 for
    256), whatever blocks hold them: blocks smaller than a span, not dividing it, and larger. On
    AMX tiles, blocks of a multiple of 16 keys are read in place and others gathered first."""
    query_lens, seq_lens = [1, 1, 40], [9, 700, 300]  # decodes first, as the scheduler orders a step
    torch.manual_seed(0)
    num_blocks = sum(-(-n // block) for n in seq_lens) + 2
    cache = torch.randn(num_blocks * block, 2, KV_HEADS, head_dim).to(kv_dtype)
    q = torch.randn(sum(query_lens), HEADS, head_dim)
    k, v = torch.randn(sum(query_lens), KV_HEADS, head_dim), torch.randn(sum(query_lens), KV_HEADS, head_dim)
    outputs = []
    fast = CpuPagedBackend(row_kernel_only=True)
    for backend in (fast, TorchReferenceBackend()):
        meta = _step(query_lens, seq_lens, num_blocks, seed=1, block=block)
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, cache.clone(), meta, head_dim**-0.5))
    torch.testing.assert_close(outputs[0], outputs[1], **tolerance(fast, kv_dtype, head_dim))


@pytest.mark.parametrize("window", [None, 37, 200])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_only_is_the_same_however_a_prompt_is_chunked(
    window: int | None, kv_dtype: torch.dtype
) -> None:
    """A 300-token prompt attended in one chunk, and again as chunks of 100 and 7 over the cache
    the earlier chunks wrote: bit-identical rows (the tiled path differs in the last bits)."""
    backend = CpuPagedBackend(row_kernel_only=True)
    torch.manual_seed(0)
    length = 300
    q = torch.randn(length, HEADS, HEAD_DIM)
    k = torch.randn(length, KV_HEADS, HEAD_DIM)
    v = torch.randn(length, KV_HEADS, HEAD_DIM)
    num_blocks = -(-length // BLOCK) + 1
    whole_meta = _step([length], [length], num_blocks, seed=3, window=window)
    backend.prepare(whole_meta)
    whole = backend.forward(
        q, k, v, torch.zeros(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM, dtype=kv_dtype), whole_meta, 0.125
    )
    cache = torch.zeros(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM, dtype=kv_dtype)
    table = whole_meta.block_tables[0].tolist()
    pieces, start = [], 0
    for size in (100, 7, 193):
        end = start + size
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]),
            block_tables=whole_meta.block_tables,
            seq_lens=torch.tensor([end]),
            query_lens=[size],
            seq_lens_list=[end],
            num_decodes=0,
            block_size=BLOCK,
            window=window,
        )
        backend.prepare(meta)
        pieces.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, meta, 0.125))
        start = end
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("level", [level.name for level in isa.machine_levels()])
def test_a_bf16_cache_runs_on_bf16_products_wherever_the_level_has_them(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the avx512_bf16 level up a bf16 cache's attention runs on VDPBF16PS, on AMX tiles at
    the amx level where the OS grants them (else VDPBF16PS); below, on the fp32 path. A path
    whose self-check failed would fall back silently: this says so."""
    monkeypatch.setenv(isa.ENV, level)
    names = [candidate.name for candidate in isa.X86_LEVELS]
    path = CpuPagedBackend().bf16_path
    if names.index(level) < names.index("avx512_bf16"):
        assert path == 0
    else:
        assert path in ((1, 2) if level == "amx" else (1,)), path


@pytest.mark.parametrize("level", [level.name for level in isa.machine_levels()])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    "lengths",
    [
        [700, 3, 129, 1000, 256],
        # 12 rows x 8 parts: enough (row, part) items that each takes every kv head in turn
        [700, 3, 129, 1000, 256, 300, 17, 512, 640, 128, 900, 45],
    ],
)
def test_a_decode_row_is_the_same_bits_in_any_batch(
    kv_dtype: torch.dtype, level: str, lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's context is split into parts by its own length only: alone, or beside rows of
    other lengths (which change how many work items the call has, and whether an item takes one
    kv head or every one), its output is bit-identical, at every instruction-set level this CPU
    runs (kernels/isa.py)."""
    monkeypatch.setenv(isa.ENV, level)
    backend = CpuPagedBackend()
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 1
    cache = torch.randn(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM).to(kv_dtype)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    k = torch.randn(len(lengths), KV_HEADS, HEAD_DIM)
    v = torch.randn(len(lengths), KV_HEADS, HEAD_DIM)
    batch_meta = _step([1] * len(lengths), lengths, num_blocks, seed=5)
    backend.prepare(batch_meta)
    batch = backend.forward(q, k, v, cache.clone(), batch_meta, 0.125)
    for i, length in enumerate(lengths):
        table = batch_meta.block_tables[i : i + 1, : -(-length // BLOCK)]
        meta = AttentionMetadata(
            slot_mapping=batch_meta.slot_mapping[i : i + 1],
            block_tables=table.contiguous(),
            seq_lens=torch.tensor([length]),
            query_lens=[1],
            seq_lens_list=[length],
            num_decodes=1,
            block_size=BLOCK,
        )
        backend.prepare(meta)
        alone = backend.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache.clone(), meta, 0.125)
        assert torch.equal(alone, batch[i : i + 1]), f"row of {length} tokens"


@pytest.mark.parametrize("level", [level.name for level in isa.machine_levels()])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [None, 50])
def test_a_prompt_row_in_a_row_tile_is_the_same_bits_as_alone(
    kv_dtype: torch.dtype, window: int | None, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Consecutive rows of a chunk share each block's loads (a row tile of the kernel); every row
    is bit-identical to the same row attended alone, as a decode row. The second sequence's rows
    continue the first's lengths (380.. after ..379) but read other blocks: no tile spans them.
    340 rows make 18 (row tile of 64, kv head) items: the chunk runs each tile's parts together,
    the row alone runs one part per item (paged_attention.c's WHOLE_TILE_ITEMS)."""
    monkeypatch.setenv(isa.ENV, level)
    backend = CpuPagedBackend(row_kernel_only=True)
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = 25
    cache = torch.randn(2 * blocks_per_seq * BLOCK, 2, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype)
    tables = torch.randperm(2 * blocks_per_seq, generator=generator).view(2, blocks_per_seq)
    lens = list(range(60, 380)) + list(range(380, 400))  # 320 rows of sequence 0 (1 to 3 parts), 20 of 1
    row_tables = torch.cat([tables[0].repeat(320, 1), tables[1].repeat(20, 1)])
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=generator)
    starts = None if window is None else torch.tensor([max(n - window, 0) for n in lens])
    tiled = torch.empty_like(q)
    backend.attend_rows(q, cache, tiled, row_tables, torch.tensor(lens), BLOCK, 0.125, starts)
    for i, length in enumerate(lens):
        alone = torch.empty_like(q[i : i + 1])
        start = None if starts is None else starts[i : i + 1]
        backend.attend_rows(
            q[i : i + 1], cache, alone, row_tables[i : i + 1], torch.tensor([length]), BLOCK, 0.125, start
        )
        assert torch.equal(alone, tiled[i : i + 1]), f"row {i} ({length} positions)"
