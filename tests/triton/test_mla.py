"""MLA decode over the paged latent cache in Triton against model/deepseek_v3/mla.py's torch path (the
engine on a tiny DeepSeek-V3 with it: test_engine.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.deepseek_v3.mla import MLAStepMetadata, _mla_decode_triton, mla_decode
from tests.triton.paged import scattered_step

BLOCK = 8


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_the_torch_path(cache_dtype, device):
    """20 heads (a full tile of 16 and a partial one), a latent of 40 and a rope key of 8."""
    torch.manual_seed(0)
    heads, nope, rope, rank, v_dim = 20, 16, 8, 40, 24
    seq_lens = [5, 37, 70]
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 2
    cache = torch.randn(num_blocks * BLOCK, rank + rope).to(cache_dtype)
    q_nope, q_rope = torch.randn(3, heads, nope), torch.randn(3, heads, rope)
    w_uk, w_uv = torch.randn(heads, nope, rank) * 0.2, torch.randn(heads, v_dim, rank) * 0.2
    meta = scattered_step([1, 1, 1], seq_lens, BLOCK, num_blocks, 4)
    expected = mla_decode(
        q_nope, q_rope, cache.float(), w_uk, w_uv, MLAStepMetadata.build(meta), 0.3
    )  # fmt: skip
    meta = scattered_step([1, 1, 1], seq_lens, BLOCK, num_blocks, 4, device=device)
    on = [t.to(device) for t in (q_nope, q_rope, cache, w_uk, w_uv)]
    out = _mla_decode_triton(*on, meta, 0.3).cpu()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
