"""Top-k / top-p / min-p truncation, the inverse-CDF draw and the grammar bitmask on the device,
against the sampler's torch code (runner/sampler.py, structured/bitmask.py)."""

from __future__ import annotations

import torch

from deepinfer.kernels.triton.bitmask import apply_bitmask_
from deepinfer.kernels.triton.sampling import draw, truncated_probs
from deepinfer.runner.sampler import truncated_probs_batch
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import bitmask as torch_bitmask

VOCAB = 1500  # two kernel tiles, the second partial

ROWS = [
    SamplingParams(temperature=1.0),  # no truncation
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=0.9, top_k=300, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=2.0, top_k=VOCAB + 5),  # k past the vocabulary: off
]


def _device_params(params: list[SamplingParams], device: str):
    f32 = dict(dtype=torch.float32, device=device)
    return (
        torch.tensor([p.temperature for p in params], **f32),
        torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
        torch.tensor([p.top_p for p in params], **f32),
        torch.tensor([p.min_p for p in params], **f32),
    )


def test_truncation_matches_the_sampler(device):
    torch.manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB) * 3
    logits[1, 100:110] = float("-inf")  # masked by a grammar
    expected = truncated_probs_batch(logits.clone(), ROWS)
    probs = truncated_probs(logits.to(device), *_device_params(ROWS, device)).cpu()
    assert torch.equal(probs > 0, expected > 0)  # the same tokens kept, row by row
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-4)
    kept = (probs > 0).sum(1).tolist()
    assert kept[1] == 5 and kept[0] == kept[5] == VOCAB and 1 < kept[2] < VOCAB


def test_draws_match_inverse_cdf(device):
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(8, VOCAB), -1)
    probs[:, 700:900] = 0.0  # a truncated stretch the draw must never land on
    probs /= probs.sum(-1, keepdim=True)
    uniforms = torch.rand(8)
    uniforms[0], uniforms[1] = 0.0, 0.999999
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, uniforms.double()[:, None] * cdf[:, -1:]).squeeze(1)
    tokens = draw(probs.to(device), uniforms.to(device)).cpu().long()
    assert tokens.tolist() == expected.clamp(max=VOCAB - 1).tolist()
    assert probs[torch.arange(8), tokens].gt(0).all()


def test_bitmask_matches_the_torch_path(device):
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB + 40)  # wider than the bitmask: the extra columns disallowed
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, -(-VOCAB // 32)), dtype=torch.int32)
    rows = [3, 1]
    expected = torch_bitmask.apply_bitmask_(logits.clone(), bitmask, rows)
    out = apply_bitmask_(logits.to(device), bitmask.to(device), torch.tensor(rows, device=device)).cpu()
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
