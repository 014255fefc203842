"""C1/C2 compression with its ring state, against DeepSeek's pure-PyTorch prefill and decode
references and against the block softmax written out in the test."""

from __future__ import annotations

import ast
import math
import tarfile
from collections.abc import Callable

import pytest
import torch

from deepinfer.model.deepseek_v4.v41_compressor import Compressor, compress_chunk, ring_size
from tests.deepseek_v41.reference import ENGINE_SDIST, reference_file

DIM = 8
_COMPRESS = "deepinfer-0.1.0/deepinfer/model_executor/layers/tilelang_ops/compress.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Callable]:
    """DeepSeek's compress_and_update_state_{prefill,decode}_ref, compiled from their file alone
    (the module around them imports its GPU kernel language)."""
    root = tmp_path_factory.mktemp("v41_compress_reference")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        tar.extract(_COMPRESS, root, filter="data")
    source = root / _COMPRESS
    wanted = {"compress_and_update_state_prefill_ref", "compress_and_update_state_decode_ref"}
    nodes = [
        n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(source), "exec"), namespace)
    return {
        "prefill": namespace["compress_and_update_state_prefill_ref"],
        "decode": namespace["compress_and_update_state_decode_ref"],
    }


def _sequence(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=gen), torch.randn(n, DIM, generator=gen) * 2


def _dense(latent: torch.Tensor, logits: torch.Tensor, ratio: int) -> torch.Tensor:
    """Entry b, channel c: sum_j e^{g[j,c]} v[j,c] / sum_j e^{g[j,c]} over the block's tokens j."""
    entries = []
    for b in range(latent.shape[0] // ratio):
        rows = range(b * ratio, (b + 1) * ratio)
        entry = []
        for c in range(DIM):
            weights = [math.exp(float(logits[j, c])) for j in rows]
            entry.append(
                sum(w * float(latent[j, c]) for w, j in zip(weights, rows, strict=True)) / sum(weights)
            )
        entries.append(entry)
    return torch.tensor(entries).reshape(-1, DIM)


def _chunked(latent, logits, chunks, state) -> torch.Tensor:
    out, start = [], 0
    for size in chunks:
        out.append(
            compress_chunk(latent[start : start + size], logits[start : start + size], state, start, 2)
        )
        start += size
    return torch.cat(out)


def test_chunks_of_any_size_equal_the_block_softmax():
    latent, logits = _sequence(17, 0)
    for chunks in ([17], [1] * 17, [3, 1, 4, 2, 5, 2], [2, 2, 13]):
        state = torch.zeros(ring_size(2, 1), 2, DIM)
        assert torch.allclose(
            _chunked(latent, logits, chunks, state), _dense(latent, logits, 2), atol=1e-6
        ), chunks


def test_prefill_chunks_equal_deepseeks_reference(reference):
    latent, logits = _sequence(15, 1)
    size = ring_size(2, 3)
    ours = torch.randn(size, 2, DIM)
    theirs = ours.clone().unsqueeze(0)  # [slots, S, 2, D]
    start = 0
    for n in (3, 1, 4, 2, 5):
        got = compress_chunk(latent[start : start + n], logits[start : start + n], ours, start, 2)
        blocks = (start + n) // 2 - start // 2
        cu_compressed = torch.tensor([0, max(blocks, 1)], dtype=torch.int32)
        expected = reference["prefill"](
            logits[start : start + n],
            latent[start : start + n],
            theirs,
            torch.tensor([0]),
            torch.zeros(max(blocks, 1), dtype=torch.int32),
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([0, start + n], dtype=torch.int32),
            cu_compressed,
            2,
        )
        # The reference rounds entries to bfloat16.
        assert got.shape == (blocks, DIM)
        assert torch.allclose(got, expected[:blocks].float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(ours, theirs[0])
        start += n


def test_decode_steps_equal_deepseeks_reference(reference):
    latent, logits = _sequence(9, 2)
    size = ring_size(2, 1)
    ours = torch.zeros(size, 2, DIM)
    theirs = ours.clone().unsqueeze(0)
    for pos in range(9):
        got = compress_chunk(latent[pos : pos + 1], logits[pos : pos + 1], ours, pos, 2)
        expected = reference["decode"](
            logits[pos : pos + 1],
            latent[pos : pos + 1],
            theirs,
            torch.tensor([0]),
            torch.tensor([pos + 1]),
            1,
            2,
        )
        if pos % 2 == 1:
            assert torch.allclose(got[0], expected[0].float(), rtol=1e-2, atol=1e-2)
        else:
            assert got.shape == (0, DIM) and not expected.any()
    assert torch.equal(ours, theirs[0])


def test_rolled_back_tokens_leave_no_trace():
    """Draft tokens 5..7 are rejected: recomputing from position 5 with other tokens gives what
    the accepted sequence gives, as long as the ring is sized for the rollback."""
    latent, logits = _sequence(8, 3)
    other_latent, other_logits = _sequence(6, 4)
    final_latent, final_logits = torch.cat([latent[:5], other_latent]), torch.cat([logits[:5], other_logits])
    for size, should_match in ((ring_size(2, 3), True), (ring_size(2, 1), False)):
        state = torch.zeros(size, 2, DIM)
        kept = compress_chunk(latent[:5], logits[:5], state, 0, 2)
        compress_chunk(latent[5:], logits[5:], state, 5, 2)  # the draft tokens, later rejected
        redone = compress_chunk(other_latent, other_logits, state, 5, 2)
        matches = torch.allclose(torch.cat([kept, redone]), _dense(final_latent, final_logits, 2), atol=1e-6)
        assert matches == should_match, size


def test_c1_entries_are_the_latents_and_need_no_state():
    latent, _ = _sequence(5, 5)
    assert torch.equal(compress_chunk(latent, None, None, 7, 1), latent)
    with pytest.raises(ValueError, match="C1 has no gate"):
        compress_chunk(latent, latent, None, 0, 1)
    with pytest.raises(ValueError, match="cannot hold a block"):
        compress_chunk(latent, latent, torch.zeros(1, 2, DIM), 0, 2)


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_projects_compresses_and_normalises(ratio):
    gen = torch.Generator().manual_seed(ratio)
    hidden, eps = 12, 1e-6
    compressor = Compressor(hidden, DIM, ratio, eps)
    compressor.wkv.data = torch.randn(DIM, hidden, generator=gen)
    if compressor.wgate is not None:
        compressor.wgate.data = torch.randn(DIM, hidden, generator=gen)
    compressor.norm.data = torch.rand(DIM, generator=gen) + 0.5
    x = torch.randn(6, hidden, generator=gen)
    state = torch.zeros(ring_size(2, 1), 2, DIM) if ratio == 2 else None
    got = compressor(x, 0, state)
    latent = x @ compressor.wkv.T
    entries = latent if ratio == 1 else _dense(latent, x @ compressor.wgate.T, 2)
    rms = entries.square().mean(-1, keepdim=True).add(eps).sqrt()
    assert torch.allclose(got, entries / rms * compressor.norm, atol=1e-5)
    with pytest.raises(ValueError, match="not 4"):
        Compressor(hidden, DIM, 4, eps)
