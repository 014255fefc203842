"""The pieces on their own: MXFP4 decoding, YaRN frequencies, the rope pair rotation, top-k ties."""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.mxfp4 import dequantize_mxfp4
from deepinfer.model.deepseek_v4.rotary import inverse_frequencies, rotate_tail
from deepinfer.model.deepseek_v4.sparse import select_entries


def test_mxfp4_decodes_every_code_with_its_block_scale():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(1, 4).view(torch.int8)  # [1, 32]: 64 values
    scale = torch.tensor([[0.5, 4.0]]).to(torch.float8_e8m0fnu)
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    expected = torch.tensor(values * 4) * torch.tensor([0.5] * 32 + [4.0] * 32)
    assert torch.equal(dequantize_mxfp4(packed, scale), expected.unsqueeze(0))
    raw_bytes = torch.tensor([[126, 129]], dtype=torch.uint8)  # e8m0 as raw bytes: 2^-1, 2^2
    assert torch.equal(dequantize_mxfp4(packed, raw_bytes), expected.unsqueeze(0))


def test_compress_rope_frequencies_equal_transformers_yarn():
    """V4-Flash's compress rope: dim 64, base 160000, YaRN factor 16 over 65536 positions."""
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from deepinfer.bench.v4_kv_memory import FLASH_CONFIG

    config = DeepseekV4Config(**{k: v for k, v in FLASH_CONFIG.items() if k != "model_type"})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, layer_type="compress")
    arch = DeepseekV4Arch.from_raw(FLASH_CONFIG)
    assert torch.equal(inverse_frequencies(arch.rope_head_dim, arch.compress_rope), theirs)
    assert attention_factor == arch.compress_rope.yarn["attention_factor"] == 1.0


def test_rotation_is_undone_by_the_inverse_and_leaves_nope_channels():
    x = torch.randn(5, 3, 16)
    angles = torch.randn(5, 4)
    rotated = rotate_tail(x, angles.cos(), angles.sin())
    assert torch.equal(rotated[..., :8], x[..., :8])
    torch.testing.assert_close(rotate_tail(rotated, angles.cos(), angles.sin(), inverse=True), x)
    # pairs (x0, x1) turn by the pair's angle: the first pair of the rope slice
    c, s = angles[:, 0].cos().unsqueeze(1), angles[:, 0].sin().unsqueeze(1)
    torch.testing.assert_close(rotated[..., 8], x[..., 8] * c - x[..., 9] * s)
    torch.testing.assert_close(rotated[..., 9], x[..., 9] * c + x[..., 8] * s)


def test_topk_ties_go_to_older_entries_whatever_the_batch():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 5.0]])
    picked = select_entries(scores, torch.tensor([6]), 3)  # entry 6 is not complete yet
    assert picked[0].nonzero().flatten().tolist() == [0, 1, 4]
    batch = torch.cat([torch.randn(7, 7), scores, torch.zeros(1, 7)])
    together = select_entries(batch, torch.tensor([7] * 7 + [6, 2]), 3)
    assert torch.equal(together[7], picked[0])
    assert together[8].nonzero().flatten().tolist() == [0, 1]  # fewer visible than k: all of them
    assert (together.sum(dim=1)[:7] == 3).all()
