"""DeepSeek-V4's sparse attention with a sink (rows named per query) against attend_with_sink."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.triton.sparse_attention import sparse_attention_with_sink
from deepinfer.model.deepseek_v4.sparse import attend_with_sink
from deepinfer.model.deepseek_v4.sparse_triton import attend_with_sink_triton, visible_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_attend_with_sink(dtype, device):
    """20 heads (a tile and a partial one), head_dim 48, lists of 40 with padding; query 3 names
    no row at all (everything on the sink), query 4 every row in one tile."""
    torch.manual_seed(0)
    n, heads, dim, rows, k = 5, 20, 48, 100, 40
    q = torch.randn(n, heads, dim).to(dtype)
    kv = torch.randn(rows, dim).to(dtype)
    sinks = torch.randn(heads)
    indices = torch.stack([torch.randperm(rows)[:k] for _ in range(n)])
    indices[0, 25:] = -1
    indices[1, ::3] = -1
    indices[3] = -1
    indices[4, 30:] = -1
    mask = torch.zeros(n, rows, dtype=torch.bool)
    for i in range(n):
        mask[i, indices[i][indices[i] >= 0]] = True
    expected = attend_with_sink(q, kv, mask, sinks, 0.15)
    out = sparse_attention_with_sink(
        q.to(device), kv.to(device), indices.to(device), sinks.to(device), 0.15
    ).cpu()  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert out[3].abs().max() == 0


def test_the_models_mask_becomes_row_lists(device):
    """V4's path on the triton backend: a [queries, keys] mask (a causal window of 4 over the keys,
    then two compressed entries seen from query 2 on; query 0 sees nothing) as per-query row lists."""
    torch.manual_seed(1)
    n, heads, dim, keys = 5, 4, 32, 9
    key_pos = torch.arange(7)
    pos = torch.arange(2, 7)
    distance = pos.unsqueeze(1) - key_pos.unsqueeze(0)
    window = (distance >= 0) & (distance < 4)
    window[0] = False
    entries = (torch.arange(n) >= 2).unsqueeze(1).expand(n, 2)
    mask = torch.cat((window, entries), dim=1)
    rows = visible_rows(mask)
    assert rows.shape == (n, 6)
    assert rows[0].tolist() == [-1] * 6 and rows[4].tolist() == [3, 4, 5, 6, 7, 8]
    q, kv, sinks = torch.randn(n, heads, dim), torch.randn(keys, dim), torch.randn(heads)
    expected = attend_with_sink(q, kv, mask, sinks, 0.2)
    on = [t.to(device) for t in (q, kv, mask, sinks)]
    out = attend_with_sink_triton(*on, 0.2).cpu()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
