"""The Triton attention backend against the PyTorch reference on mixed steps over scattered
block tables: decode rows, short chunks (speculative verification), prefill chunks after a prefix
and from position 0, with GQA, sliding windows and fp32/fp16/bf16/fp8 caches."""

from __future__ import annotations

import pytest
import torch

from deepinfer.attention.backend import TorchReferenceBackend
from deepinfer.attention.triton_backend import TritonBackend
from deepinfer.kernels.triton.paged_attention import paged_decode, paged_prefill, prefill_tiles
from tests.triton.paged import scattered_step

BLOCK = 8

STEPS = [
    ([1, 1, 1], [3, 40, 70]),  # decodes only: a context inside one block, and over several
    ([1, 5, 20], [33, 50, 20]),  # a decode, a verification chunk, a whole prompt of two tiles
    ([17], [60]),  # a chunk after a prefix, one query over a tile
]


def _run(backend, meta, q, k, v, cache, scale):
    backend.prepare(meta)
    return backend.forward(q, k, v, cache, meta, scale)


def _compare(
    query_lens, seq_lens, heads, kv_heads, head_dim, kv_dtype, window, device, q_dtype=torch.float32
):
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 2
    cache = torch.randn(num_blocks * BLOCK, 2, kv_heads, head_dim).to(kv_dtype)
    if window is not None:  # released blocks point at block 0: reading one would poison the output
        cache[:BLOCK] = float("nan")
    tokens = sum(query_lens)
    q, k, v = (torch.randn(tokens, n, head_dim).to(q_dtype) for n in (heads, kv_heads, kv_heads))
    scale = head_dim**-0.5
    reference = _run(
        TorchReferenceBackend(), scattered_step(query_lens, seq_lens, BLOCK, num_blocks, 1, window),
        q, k, v, cache.clone(), scale,
    )  # fmt: skip
    meta = scattered_step(query_lens, seq_lens, BLOCK, num_blocks, 1, window, device)
    triton_cache = cache.to(device)
    out = _run(
        # parts of 8 positions: long rows split and merged, short ones beside empty parts
        TritonBackend(torch.device(device), decode_part=8),
        meta,
        q.to(device),
        k.to(device),
        v.to(device),
        triton_cache,
        scale,
    )
    return out.cpu(), reference


@pytest.mark.parametrize(("query_lens", "seq_lens"), STEPS)
@pytest.mark.parametrize("window", [None, 11])
def test_backend_matches_reference(query_lens, seq_lens, window, device):
    out, reference = _compare(query_lens, seq_lens, 4, 2, 32, torch.float32, window, device)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_half_caches_match_reference(kv_dtype, device):
    """Both backends read the same rounded values, so they still agree closely."""
    out, reference = _compare([1, 1, 9], [21, 5, 30], 4, 2, 32, kv_dtype, 11, device)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 1, 40), (3, 3, 16)])
def test_other_head_shapes(heads, kv_heads, head_dim, device):
    """A group of six (padded to eight) and a head_dim that is no power of two; no GQA at all."""
    out, reference = _compare([1, 1, 6], [9, 30, 25], heads, kv_heads, head_dim, torch.float32, None, device)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)


def test_bfloat16_model(device):
    """A bf16 model's queries: the prefill dots run in bf16 with fp32 accumulation."""
    out, reference = _compare([1, 12], [30, 12], 4, 2, 32, torch.bfloat16, None, device, torch.bfloat16)
    torch.testing.assert_close(out.float(), reference.float(), atol=3e-2, rtol=3e-2)


def test_fp8_cache_with_scales(device):
    """An fp8 (e4m3) cache read as value * scale, one scale for K and one for V."""
    torch.manual_seed(0)
    query_lens, seq_lens, heads, kv_heads, head_dim = [1, 1, 7], [26, 9, 20], 4, 2, 32
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 2
    k_scale, v_scale = 0.05, 0.02
    values = torch.randn(num_blocks * BLOCK, 2, kv_heads, head_dim)
    fp8 = torch.stack([values[:, 0] / k_scale, values[:, 1] / v_scale], 1).to(torch.float8_e4m3fn)
    dequantized = torch.stack([fp8[:, 0].float() * k_scale, fp8[:, 1].float() * v_scale], 1)
    meta = scattered_step(query_lens, seq_lens, BLOCK, num_blocks, 2)
    q = torch.randn(sum(query_lens), heads, head_dim)
    # the step's own K/V are already in the cache: the reference's write changes nothing
    k, v = dequantized[meta.slot_mapping, 0], dequantized[meta.slot_mapping, 1]
    reference = _run(TorchReferenceBackend(), meta, q, k, v, dequantized, head_dim**-0.5)

    meta = scattered_step(query_lens, seq_lens, BLOCK, num_blocks, 2, device=device)
    q, cache = q.to(device), fp8.to(device)
    out = torch.empty_like(q)
    d = meta.num_decodes
    lens = meta.seq_lens[:d]
    paged_decode(
        out[:d], q[:d], cache, meta.block_tables[:d], lens, torch.zeros_like(lens), BLOCK, head_dim**-0.5,
        k_scale, v_scale,
    )  # fmt: skip
    tiles = prefill_tiles([(2, 2, 7, 20)], 16, torch.device(device))
    paged_prefill(out, q, cache, meta.block_tables, tiles, BLOCK, head_dim**-0.5, None, 16, k_scale, v_scale)
    torch.testing.assert_close(out.cpu(), reference, atol=2e-5, rtol=1e-4)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        TritonBackend(torch.device("cpu"))
