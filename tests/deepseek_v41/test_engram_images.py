"""Engram with image tokens: n-gram windows cut at images as DeepSeek's engine builds them (its
`gather_engram_tokens_zos_ref`, image sentinel -1), table rows and the gate against TileKernels'
references with an image mask, and loops from the rule; a mixed batch equals each sequence
alone, and a prompt chunked across an image equals it whole, in Engram and in the model."""

from __future__ import annotations

import tarfile
from collections.abc import Callable

import pytest
import torch

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.engram import (
    GATE_CLAMP,
    IMAGE_SENTINEL,
    EngramHashing,
    with_image_sentinels,
)
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from tests.deepseek_v41 import test_engram as base
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.reference import ENGINE_SDIST, reference_file
from tests.deepseek_v41.test_engram import _arch, _engrams, _exec_nodes, _loop_rows
from tests.deepseek_v41.tiny_v41 import build_v41, tiny_config

_DS_GATHER = "deepinfer-0.1.0/deepinfer/model_executor/layers/tilelang_ops/gather_engram_tokens_zos.py"
# TileKernels' references and the tiny checkpoint, shared with the text-only Engram tests.
tk, tiny, loaded = base.tk, base.tiny, base.loaded
CHUNK = 6  # the longest chunk DeepSeek's gather reference is given (its max_seqlen_q)


@pytest.fixture(scope="module")
def ds_gather(tmp_path_factory) -> Callable:
    """DeepSeek's CPU reference of its n-gram gather (fresh sequences: a window of the tokens
    before the chunk, then the chunk's own), from the engine's sources alone."""
    root = tmp_path_factory.mktemp("v41_engram_gather")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        tar.extract(_DS_GATHER, root, filter="data")
    source = (root / _DS_GATHER).read_text()
    return _exec_nodes(source, _DS_GATHER, {"gather_engram_tokens_zos_ref"}, {"torch": torch})[
        "gather_engram_tokens_zos_ref"
    ]


def _chunks(
    vocab: int, lens: list[int], n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random chunks: token ids [T], image mask [T] (about 2 in 5), context [S, n - 1] of raw ids
    with IMAGE_SENTINEL at image positions (some chunks start their sequence: all pad)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (sum(lens),), generator=gen)
    mask = torch.rand(sum(lens), generator=gen) < 0.4
    context = torch.randint(3, vocab, (len(lens), n - 1), generator=gen)
    context[torch.rand(context.shape, generator=gen) < 0.4] = IMAGE_SENTINEL
    context[0] = 2  # a fresh sequence
    return tokens, mask, context


def _loop_windows(
    tokens: list[int], mask: list[bool], lens: list[int], context: list[list[int]], pad: int, n: int
):
    """The rule token by token: walk back from the token; before the sequence reads pad, and from
    the first image position reached on, every column is pad."""
    out, start = [], 0
    for seq, length in enumerate(lens):
        ids = context[seq] + [
            IMAGE_SENTINEL if m else t
            for t, m in zip(tokens[start : start + length], mask[start : start + length], strict=True)
        ]
        for p in range(n - 1, n - 1 + length):
            row, cut = [], False
            for r in range(n):
                cut = cut or ids[p - r] == IMAGE_SENTINEL
                row.append(pad if cut else ids[p - r])
            out.append(row)
        start += length
    return out


@pytest.mark.parametrize("compressed", [None, 40])
def test_windows_equal_deepseeks_gather_and_the_rule(ds_gather, compressed):
    n = 4
    arch = _arch(engram_max_ngram_size=n, engram_compressed_vocab_size=compressed)
    vocab_map = None if compressed is None else torch.arange(arch.vocab_size) % compressed
    hashing = EngramHashing.from_arch(arch, vocab_map)
    lens = [6, 1, 4, 6, 3, 2, 5]
    tokens, mask, context = _chunks(arch.vocab_size, lens, n, seed=1)
    ours = hashing.windows(tokens, torch.tensor(lens), context, mask)
    # DeepSeek's side holds compressed ids, the sentinel at image positions.
    squash = (
        (lambda t: t) if vocab_map is None else (lambda t: torch.where(t < 0, t, vocab_map[t.clamp(min=0)]))
    )
    own = squash(with_image_sentinels(tokens, mask))
    fresh = torch.zeros(len(lens), CHUNK, dtype=torch.int32)
    for i, piece in enumerate(own.split(lens)):
        fresh[i, : len(piece)] = piece.int()
    seqlens = torch.tensor(lens, dtype=torch.int32)
    pad = int(squash(torch.tensor([arch.engram.pad_token_id]))[0])
    theirs = ds_gather(
        squash(context).int(),
        fresh,
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, CHUNK - 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.full((len(lens),), -1, dtype=torch.int32),  # every sequence fresh (no remap)
        torch.arange(arch.vocab_size, dtype=torch.int32),
        seqlens,
        torch.cumsum(seqlens, 0, dtype=torch.int32),
        sum(lens),
        max_seqlen_q=CHUNK,
        max_ngram_size=n,
        engram_compressed_pad_token=pad,
        image_sentinel=IMAGE_SENTINEL,
    )
    assert torch.equal(ours, theirs.long())
    raw = _loop_windows(tokens.tolist(), mask.tolist(), lens, context.tolist(), arch.engram.pad_token_id, n)
    assert ours.tolist() == (raw if vocab_map is None else vocab_map[torch.tensor(raw)].tolist())
    # Without the mask the windows read the image tokens' ids: they differ.
    assert not torch.equal(hashing.windows(tokens, torch.tensor(lens), context.clamp(min=3)), ours)


def test_rows_equal_tile_kernels_with_an_image_mask_and_the_rule(tk):
    n, heads = 3, 2
    arch = _arch(engram_max_ngram_size=n, engram_n_heads=heads)
    hashing = EngramHashing.from_arch(arch)
    lens = [7, 5]
    tokens, mask, _ = _chunks(arch.vocab_size, lens, n, seed=2)
    windows = hashing.windows(tokens, torch.tensor(lens), image_mask=mask)
    reference = tk["engram_hash_ref"](
        windows.int(),
        hashing.multipliers,
        hashing.table_sizes.int(),
        tk["make_offsets"](hashing.table_sizes.int()),
        mask,
    )  # [layers, T, (n - 1) * heads], -1 on image rows
    pad = arch.engram.pad_token_id
    for i, layer in enumerate(arch.engram.layer_ids):
        ours = hashing.rows(layer, windows, mask)
        assert torch.equal(ours, reference[i].long())
        assert (ours[mask] == -1).all() and (ours[~mask] >= 0).all()
        # The rule: each window, oldest first, as an n-token sequence: its last row is this row's.
        per_row = [_loop_rows(arch, layer, row[::-1], [n], pad)[-1] for row in windows.tolist()]
        expected = torch.tensor(per_row).masked_fill(mask[:, None], -1)
        assert torch.equal(ours, expected)


def test_image_rows_keep_their_streams_and_text_rows_equal_tile_kernels(loaded, tiny, tk):
    arch, weights = loaded
    engrams = _engrams(arch, weights)
    lens = [6, 5]
    tokens, mask, _ = _chunks(arch.vocab_size, lens, arch.engram.max_ngram_size, seed=3)
    assert mask.any() and (~mask).any()
    streams = torch.randn(
        sum(lens), arch.hc_mult, arch.hidden_size, generator=torch.Generator().manual_seed(4)
    )
    seq_lens = torch.tensor(lens)
    for layer, engram in engrams.items():
        out = engram(streams, tokens, seq_lens, image_mask=mask)
        assert torch.equal(out[mask], streams[mask])
        windows = engram.hashing.windows(tokens, seq_lens, image_mask=mask)
        rows = engram.hashing.rows(layer, windows)
        p = f"layers.{layer}.engram."
        kv = tiny.values[p + "embed.weight"][rows].flatten(1) @ tiny.values[p + "wkv.weight"].T
        kv = kv.unflatten(1, (arch.hc_mult + 1, arch.hidden_size))
        reference = tk["engram_gate_ref"](
            streams,
            kv,
            tiny.values[p + "q_weight"],
            tiny.values[p + "k_weight"],
            GATE_CLAMP,
            arch.rms_norm_eps,
            image_token_mask=mask,
        )  # bfloat16: compare within its rounding
        torch.testing.assert_close(out, reference.float(), rtol=1.6e-2, atol=1e-5)
        # The mask ignored: image rows change, and the text right after an image hashes the
        # image tokens' ids.
        ignored = engram(streams, tokens, seq_lens)
        assert not torch.allclose(ignored[mask], streams[mask])
        after = torch.zeros_like(mask)
        after[1:] = mask[:-1] & ~mask[1:]
        after[lens[0]] = False  # a sequence's first token follows nothing of its own
        assert after.any() and not torch.allclose(ignored[after], out[after])


def test_a_mixed_batch_and_chunks_across_an_image_equal_each_sequence_whole(loaded):
    arch, weights = loaded
    engram = _engrams(arch, weights)[4]
    hashing = engram.hashing
    lens = [12, 4, 9]
    tokens, _, _ = _chunks(arch.vocab_size, lens, arch.engram.max_ngram_size, seed=5)
    mask = torch.zeros(sum(lens), dtype=torch.bool)
    mask[3:8] = True  # an image inside the first sequence
    mask[16 + 2 : 16 + 4] = True  # the third: an image near its start; the second all text
    streams = torch.randn(
        sum(lens), arch.hc_mult, arch.hidden_size, generator=torch.Generator().manual_seed(6)
    )
    seq_lens = torch.tensor(lens)

    def rows(t, m, n, context=None):
        return hashing.rows(4, hashing.windows(t, torch.tensor(n), context, m), m)

    whole = rows(tokens, mask, lens)
    pieces = list(zip(tokens.split(lens), mask.split(lens), streams.split(lens), strict=True))
    assert torch.equal(whole, torch.cat([rows(t, m, [len(t)]) for t, m, _ in pieces]))
    batched = engram(streams, tokens, seq_lens, image_mask=mask)
    alone = torch.cat([engram(s, t, torch.tensor([len(t)]), image_mask=m) for t, m, s in pieces])
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-5)
    # The first sequence in chunks of 2, 3, 4, 3: inside the image, at its end, after it. The
    # context is what the sequence keeps: its ids, the sentinel at image positions.
    t0, m0, s0 = pieces[0]
    kept = with_image_sentinels(t0, m0)
    start = 0
    for size in (2, 3, 4, 3):
        chunk = slice(start, start + size)
        context = hashing.context([kept[:start].tolist()])
        assert torch.equal(rows(t0[chunk], m0[chunk], [size], context), whole[chunk])
        out = engram(s0[chunk], t0[chunk], torch.tensor([size]), context, m0[chunk])
        torch.testing.assert_close(out, batched[chunk], rtol=1e-6, atol=1e-5)
        start += size
    # Context of the raw ids (the image positions' mask lost): the chunk after the image differs.
    lost = hashing.context([t0[:9].tolist()])
    assert not torch.equal(rows(t0[9:], m0[9:], [3], lost), whole[9:12])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> DeepseekV41ForCausalLM:
    path = tmp_path_factory.mktemp("v41_engram_images") / "tiny"
    build_v41(path, tiny_config(), seed=0)
    return DeepseekV41ForCausalLM.from_pretrained(path)


def test_the_model_chunked_across_an_image_equals_it_whole(model):
    n = 20
    ids = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[5:12] = True
    ids[mask] = 7  # the positions hold one placeholder id, as the API side writes them
    embeds = torch.randn(int(mask.sum()), model.arch.hidden_size, generator=torch.Generator().manual_seed(8))

    def run(chunks: list[int]) -> tuple[torch.Tensor, list[int]]:
        cache = ContiguousV41Cache(model.arch)
        seq = cache.add_sequence()
        out, start, used = [], 0, 0
        with torch.no_grad():
            for size in chunks:
                m = mask[start : start + size]
                layout = StepLayout((start,), (size,))
                out.append(
                    model.forward_cached(
                        ids[start : start + size],
                        torch.arange(start, start + size),
                        layout,
                        cache.step([seq], layout),
                        image_mask=m,
                        image_embeds=embeds[used : used + int(m.sum())],
                    )
                )
                start, used = start + size, used + int(m.sum())
        return torch.cat(out), cache.tokens(seq)

    whole, kept = run([n])
    assert kept == with_image_sentinels(ids, mask).tolist()  # the sentinel kept per position
    chunked, _ = run([7, 5, 1, 7])  # inside the image, at its end, right after it, later
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-4)
