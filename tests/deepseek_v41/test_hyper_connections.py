"""Hyper-connections, plain and shifted (V4.1), against TileKernels' pure-PyTorch mHC reference
and against the formulas written out token by token."""

from __future__ import annotations

import importlib.util
import math
import zipfile
from types import ModuleType

import pytest
import torch

from deepinfer.model.deepseek_v4.mhc import HyperConnection
from tests.deepseek_v41.reference import TILE_KERNELS_WHEEL, reference_file

HIDDEN, STREAMS, ITERS, HC_EPS, NORM_EPS = 16, 4, 20, 1e-6, 1e-6


@pytest.fixture(scope="module")
def tile_mhc(tmp_path_factory) -> ModuleType:
    """tile_kernels/torch/mhc.py, loaded from the wheel by file path (it imports only torch)."""
    root = tmp_path_factory.mktemp("tile_kernels")
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        path = wheel.extract("tile_kernels/torch/mhc.py", root)
    spec = importlib.util.spec_from_file_location("tile_kernels_mhc_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hc(seed: int) -> HyperConnection:
    gen = torch.Generator().manual_seed(seed)
    hc = HyperConnection(HIDDEN, STREAMS, ITERS, HC_EPS, NORM_EPS)
    hc.fn.data = torch.randn(hc.fn.shape, generator=gen) * 0.3
    hc.base.data = torch.randn(hc.base.shape, generator=gen)
    hc.scale.data = torch.rand(3, generator=gen) + 0.5
    return hc


def _streams(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, STREAMS, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def test_mixes_equal_the_reference(tile_mhc):
    hc, streams = _hc(0), _streams(6, 1)
    pre, post, comb = hc.mixes(streams)
    mixes = tile_mhc.mhc_pre_norm_fn_ref(streams.unsqueeze(0), hc.fn, None, NORM_EPS)
    pre_ref, post_ref, comb_logits = tile_mhc.mhc_pre_split_mixes_ref(
        mixes, hc.scale, hc.base, STREAMS, 2.0, HC_EPS
    )
    comb_ref = tile_mhc.sinkhorn_normalize_ref(comb_logits, repeat=ITERS, eps=HC_EPS)
    assert _close(pre, pre_ref[0, :, :, 0], 1e-5)
    assert _close(post, post_ref[0, :, :, 0], 1e-5)
    assert _close(comb, comb_ref[0], 1e-5)


def test_shifted_collapse_and_expand_equal_the_reference(tile_mhc):
    """The reference rounds its outputs to bfloat16: compared at bfloat16's precision."""
    hc, streams = _hc(2), _streams(5, 3)
    carried = torch.softmax(torch.randn(5, STREAMS), dim=-1)
    collapsed, post, comb, pre = hc.forward_shifted(streams, carried)
    assert _close(
        collapsed, tile_mhc.mhc_pre_apply_mix_ref(streams.unsqueeze(0), carried[None, :, :, None])[0], 1e-2
    )
    assert torch.equal(pre, hc.mixes(streams)[0])
    out = torch.randn(5, HIDDEN)
    expanded = HyperConnection.expand(streams, out, post, comb)
    reference = tile_mhc.mhc_post_ref(
        out.unsqueeze(0), streams.unsqueeze(0), post[None, :, :, None], comb.unsqueeze(0)
    )
    assert _close(expanded, reference[0], 1e-2)


def test_first_shifted_block_reads_the_embedding():
    hidden = torch.randn(3, HIDDEN)
    streams = hidden.unsqueeze(1).expand(-1, STREAMS, -1)
    assert torch.equal(HyperConnection.collapse(streams, HyperConnection.first_pre(3, STREAMS)), hidden)


def _dense_mixes(hc: HyperConnection, r: torch.Tensor) -> tuple[list[float], list[float], list[list[float]]]:
    """One token's streams r [N, D] -> pre, post, comb from the formulas, element by element."""
    n, flat = STREAMS, r.flatten().tolist()
    rms = math.sqrt(sum(v * v for v in flat) / len(flat) + NORM_EPS)
    z = [sum(w * v for w, v in zip(row, flat, strict=True)) / rms for row in hc.fn.tolist()]
    base, (s_pre, s_post, s_comb) = hc.base.tolist(), hc.scale.tolist()
    sigmoid = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pre = [sigmoid(z[i] * s_pre + base[i]) + HC_EPS for i in range(n)]
    post = [2 * sigmoid(z[n + i] * s_post + base[n + i]) for i in range(n)]
    logits = [[z[2 * n + i * n + j] * s_comb + base[2 * n + i * n + j] for j in range(n)] for i in range(n)]
    comb = []
    for row in logits:
        e = [math.exp(v - max(row)) for v in row]
        comb.append([v / sum(e) + HC_EPS for v in e])

    def normalize_columns() -> None:
        for j in range(n):
            total = sum(comb[i][j] for i in range(n)) + HC_EPS
            for i in range(n):
                comb[i][j] /= total

    normalize_columns()
    for _ in range(ITERS - 1):
        for i in range(n):
            total = sum(comb[i]) + HC_EPS
            comb[i] = [v / total for v in comb[i]]
        normalize_columns()
    return pre, post, comb


def _dense_shifted_stack(hcs, blocks, hidden: torch.Tensor) -> torch.Tensor:
    """Token by token: block k reads the streams with block k-1's pre (block 0: stream 0), writes
    back with its own post and comb; the last pre collapses the final streams."""
    outputs = []
    for h in hidden:
        r = h.unsqueeze(0).repeat(STREAMS, 1)
        carried = [1.0] + [0.0] * (STREAMS - 1)
        for hc, block in zip(hcs, blocks, strict=True):
            pre, post, comb = _dense_mixes(hc, r)
            x = sum(carried[i] * r[i] for i in range(STREAMS))
            out = block(x)
            r = torch.stack(
                [post[j] * out + sum(comb[i][j] * r[i] for i in range(STREAMS)) for j in range(STREAMS)]
            )
            carried = pre
        outputs.append(sum(carried[i] * r[i] for i in range(STREAMS)))
    return torch.stack(outputs)


def _blocks(count: int) -> list:
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5 for _ in range(count)]
    return [lambda x, w=w: torch.tanh(x @ w) for w in weights]


def test_shifted_stack_equals_the_formulas():
    hcs, blocks = [_hc(10 + k) for k in range(6)], _blocks(6)  # three layers: attention, MoE each
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    streams = hidden.unsqueeze(1).expand(-1, STREAMS, -1)
    carried = HyperConnection.first_pre(4, STREAMS)
    for hc, block in zip(hcs, blocks, strict=True):
        x, post, comb, carried = hc.forward_shifted(streams, carried)
        streams = HyperConnection.expand(streams, block(x), post, comb)
    shifted = HyperConnection.collapse(streams, carried)
    assert _close(shifted, _dense_shifted_stack(hcs, blocks, hidden), 1e-5)

    plain = hidden.unsqueeze(1).expand(-1, STREAMS, -1)
    for hc, block in zip(hcs, blocks, strict=True):
        x, post, comb = hc(plain)
        plain = HyperConnection.expand(plain, block(x), post, comb)
    assert not _close(HyperConnection.collapse(plain, carried), shifted, 1e-2)  # the shift matters
