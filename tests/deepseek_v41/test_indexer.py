"""The V4.1 lightning indexer: FP4 emulation against TileKernels' quantizer and the e2m1 grid,
candidate blocks against DeepSeek's pure-PyTorch references, scores and top-k against dense
loops written from the formula, and a flattened batch against one sequence at a time."""

from __future__ import annotations

import ast
import math
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.config import RopeSpec
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_indexer import (
    CandidateRole,
    V41Indexer,
    candidate_block_scores,
    candidate_entries,
    choose_candidate_blocks,
    fp4_round_trip,
    index_scores,
    select,
    top_indices,
    top_indices_in_candidates,
    visible_entries,
)
from tests.deepseek_v41.reference import ENGINE_SDIST, TILE_KERNELS_WHEEL, reference_file
from tests.deepseek_v41.tiny_v41 import tiny_config

_CANDIDATES = "deepinfer-0.1.0/deepinfer/model_executor/layers/tilelang_ops/candidate_blocks.py"
_CAST = "tile_kernels/torch/cast.py"
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of codes 0..7


def _compile(source: Path, wanted: set[str], namespace: dict) -> dict:
    """Exec only the named top-level functions of a reference file (its imports need GPUs)."""
    nodes = [
        n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    assert {n.name for n in nodes} == wanted
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(source), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def candidate_ref(tmp_path_factory) -> dict[str, Callable]:
    root = tmp_path_factory.mktemp("v41_candidate_reference")
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        tar.extract(_CANDIDATES, root, filter="data")
    wanted = {
        "candidate_block_max_ref",
        "get_candidate_compact_lens_ref",
        "restore_candidate_indices_inplace_ref",
        "_check_inputs",
    }
    return _compile(root / _CANDIDATES, wanted, {"torch": torch})


@pytest.fixture(scope="module")
def cast_ref(tmp_path_factory) -> Callable:
    """TileKernels' PyTorch `cast` (the reference of the engine's per-token FP4 quantizer), with
    the few helpers it imports written out: no Ascend, and the e2m1 amax floor of its config."""
    root = tmp_path_factory.mktemp("v41_cast_reference")
    with zipfile.ZipFile(reference_file(TILE_KERNELS_WHEEL)) as wheel:
        wheel.extract(_CAST, root)
    namespace = {
        "torch": torch,
        "F": F,
        "Optional": object,
        "Sequence": object,
        "Union": object,
        "QuantTensor": tuple,
        "align": lambda x, a: -(-x // a) * a,
        "ceil_div": lambda x, a: -(-x // a),
        "is_ascend": lambda: False,
        "get_packed_ue8m0_pack_factor": lambda: 4,  # UE8M0 bytes per int32 (unpacked scales here)
        "get_amax_clamp_for_quant": lambda fmt, e4m3_sf: 6.0 * 2.0**-126,
    }
    return _compile(root / _CAST, {"cast", "convert_to_e2m1_bits", "get_max_quant_val"}, namespace)["cast"]


def _decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[rows, D / 2] int8, two codes a byte (low nibble first) -> [rows, D] float32."""
    grid = torch.tensor(E2M1_GRID)
    byte = packed.view(torch.uint8).long()
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)
    return grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)


# --- FP4 ------------------------------------------------------------------------------------


def _fp4_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, 32, generator=gen)
    x = x * 2.0 ** torch.randint(-30, 30, (24, 4, 1), generator=gen).float()  # one magnitude per group
    x[3, 1] = 0  # an all-zero group
    x[5, 2] = 0
    x[5, 2, :8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * 2.0**-3  # exact ties
    return x.flatten(1).to(torch.bfloat16)  # the engine quantizes bfloat16 activations


def test_fp4_round_trip_equals_tilekernels_quantizer(cast_ref):
    x = _fp4_inputs()
    packed, scales = cast_ref(x, "e2m1", block_size=(1, 32), round_sf=True)
    expected = _decode_e2m1(packed) * scales.repeat_interleave(32, dim=1)
    assert torch.equal(fp4_round_trip(x), expected)


def test_fp4_values_lie_on_the_e2m1_grid_times_a_power_of_two():
    x = _fp4_inputs().float()
    got = fp4_round_trip(x).unflatten(-1, (-1, 32))
    groups = x.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1, keepdim=True)
    # The smallest power of two with amax / scale <= 6 (zero groups: the floor 2^-126).
    scale = torch.exp2(torch.ceil(torch.log2((amax / 6).clamp(min=2.0**-126))))
    units = got / scale
    assert torch.isin(units.abs(), torch.tensor(E2M1_GRID)).all()
    # amax / scale lies in (3, 6]: each group's largest channel lands on 3, 4 or 6 (zero groups: 0).
    assert ((units.abs().amax(-1) >= 3) | (amax.squeeze(-1) == 0)).all()
    # Round to nearest: no grid value is closer than the one chosen.
    grid = torch.tensor(E2M1_GRID)
    err = ((groups.abs() / scale).unsqueeze(-1) - grid).abs().amin(-1)
    assert torch.allclose((groups.abs() / scale - units.abs()).abs(), err)
    # Ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    ties = got[5, 2, :8] * 2.0**3
    assert ties.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_round_trip(torch.ones(2, 48))


# --- candidate blocks against DeepSeek's references -----------------------------------------


def _scores(n: int, entries: int, seed: int) -> torch.Tensor:
    """Non-negative bfloat16 scores with many exact ties (zeros and few distinct values)."""
    gen = torch.Generator().manual_seed(seed)
    raw = F.relu(torch.randn(n, entries, generator=gen))
    return (raw * 4).round().div(4).to(torch.bfloat16)


def _visible(n: int, entries: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 100)
    visible = torch.randint(0, entries + 1, (n,), generator=gen)
    visible[0], visible[-1] = 0, entries
    return visible


def _best(scores: list[float], allowed: list[int], k: int) -> list[int]:
    """The k best allowed columns, equal scores to the lower column, ascending, -1 padded."""
    picked = sorted(sorted(allowed, key=lambda j: (-scores[j], j))[:k])
    return picked + [-1] * (k - len(picked))


CASES = [(3, 8), (5, 16), (13, 8), (40, 8), (57, 16), (203, 16)]  # (entries, block size)


@pytest.mark.parametrize(("entries", "block_size"), CASES)
def test_block_scores_equal_deepseeks_reference(candidate_ref, entries, block_size):
    scores, visible = _scores(7, entries, entries), _visible(7, entries, entries)
    scores[-1, 0] = float("inf")  # an overflowed logit is capped below the newest block's +inf
    got, valid_blocks = candidate_block_scores(scores, visible, block_size)
    expected, expected_valid = candidate_ref["candidate_block_max_ref"](scores, visible.int(), block_size)
    assert torch.equal(valid_blocks, expected_valid.long())
    valid = torch.arange(expected.shape[1]) < expected_valid.unsqueeze(1)
    assert torch.equal(got[valid].view(torch.int16), expected[valid].view(torch.int16))


@pytest.mark.parametrize(("entries", "block_size"), CASES)
def test_candidate_blocks_are_the_best_reference_blocks(candidate_ref, entries, block_size):
    scores, visible = _scores(7, entries, entries), _visible(7, entries, entries)
    topk_blocks = 4
    got = choose_candidate_blocks(scores, visible, block_size, topk_blocks)
    block_scores, valid_blocks = candidate_ref["candidate_block_max_ref"](scores, visible.int(), block_size)
    for row in range(7):
        count = int(valid_blocks[row])
        expected = _best(block_scores[row].float().tolist(), list(range(count)), topk_blocks)
        assert got[row].tolist() == expected, row
        if count:
            assert count - 1 in expected  # the newest block is always a candidate


@pytest.mark.parametrize(("entries", "block_size"), CASES)
def test_top_k_in_candidates_equals_reference_compact_selection(candidate_ref, entries, block_size):
    """The engine scores the candidates' entries in a compact layout, picks there and restores
    entry numbers (restore_candidate_indices_inplace_ref); we must pick the same entries."""
    source, consumer = _scores(7, entries, entries), _scores(7, entries, entries + 1)
    visible, topk_blocks, k = _visible(7, entries, entries), 4, 12
    candidates = choose_candidate_blocks(source, visible, block_size, topk_blocks)
    compact_lens = candidate_ref["get_candidate_compact_lens_ref"](
        candidates.int(), visible.int(), block_size
    )
    assert torch.equal((candidate_entries(candidates, visible, block_size) >= 0).sum(1), compact_lens.long())

    got = top_indices_in_candidates(consumer, visible, candidates, block_size, k)
    compact_picks = []
    for row in range(7):
        compact = []
        for column in range(topk_blocks * block_size):
            block, offset = int(candidates[row, column // block_size]), column % block_size
            entry = block * block_size + offset
            usable = block >= 0 and entry < int(visible[row])
            compact.append(float(consumer[row, entry]) if usable else None)
        allowed = [c for c, s in enumerate(compact) if s is not None]
        compact_picks.append(_best([s or 0.0 for s in compact], allowed, k))
    restored = torch.tensor(compact_picks, dtype=torch.int32)
    candidate_ref["restore_candidate_indices_inplace_ref"](restored, candidates.int(), block_size)
    assert torch.equal(got, restored.long())
    assert ((got < visible.unsqueeze(1)) | (got == -1)).all()


# --- scores and top-k against dense loops ---------------------------------------------------


def _dense_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    n, heads, dim = q.shape
    out = torch.zeros(n, keys.shape[0], dtype=torch.float64)
    for i in range(n):
        for e in range(keys.shape[0]):
            for h in range(heads):
                dot = sum(float(q[i, h, d]) * float(keys[e, d]) for d in range(dim))
                out[i, e] += float(weights[i, h]) * max(dot, 0.0)
    return out


def test_scores_follow_the_formula_and_round_to_bfloat16():
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(5, 3, 32, generator=gen), torch.randn(9, 32, generator=gen)
    weights = torch.randn(5, 3, generator=gen)
    got = index_scores(q, weights, keys)
    assert got.dtype == torch.bfloat16
    dense = _dense_scores(q, weights, keys)
    assert torch.allclose(got.double(), dense, rtol=2**-8, atol=1e-5)
    assert torch.equal(got, dense.float().to(torch.bfloat16))  # one rounding, nothing else


@pytest.mark.parametrize(("ratio", "entries"), [(1, 5), (2, 9), (2, 40)])
def test_top_k_sees_only_completed_windows_and_breaks_ties_low(ratio, entries):
    k = 8
    positions = torch.arange(entries * ratio)
    visible = visible_entries(positions, ratio)
    assert visible.tolist() == [(p + 1) // ratio for p in range(entries * ratio)]
    scores = _scores(positions.shape[0], entries, ratio * 100 + entries)
    valid = torch.arange(entries) < visible.unsqueeze(1)
    got = top_indices(scores, valid, k)
    for row, p in enumerate(positions.tolist()):
        allowed = [e for e in range(entries) if e * ratio + ratio - 1 <= p]
        assert got[row].tolist() == _best(scores[row].float().tolist(), allowed, k), row


def test_consumer_picks_within_candidates_from_dense_loop():
    entries, block_size, topk_blocks, k = 70, 8, 4, 10
    positions = torch.arange(2 * entries)
    visible = visible_entries(positions, 2)
    source, consumer = _scores(positions.shape[0], entries, 7), _scores(positions.shape[0], entries, 8)
    candidates = choose_candidate_blocks(source, visible, block_size, topk_blocks)
    got = top_indices_in_candidates(consumer, visible, candidates, block_size, k)
    for row in range(positions.shape[0]):
        blocks = {b for b in candidates[row].tolist() if b >= 0}
        allowed = [e for e in range(int(visible[row])) if e // block_size in blocks]
        assert got[row].tolist() == _best(consumer[row].float().tolist(), allowed, k), row


# --- the module and batching ----------------------------------------------------------------

HIDDEN, Q_RANK, LATENT, HEADS, DIM, TOPK = 16, 12, 24, 2, 64, 6


def _indexer(candidate: CandidateRole | None, seed: int, ratio: int = 2) -> V41Indexer:
    gen = torch.Generator().manual_seed(seed)
    rope = TrailingRope(32, RopeSpec(theta=10000.0, yarn=None))
    indexer = V41Indexer(HIDDEN, Q_RANK, LATENT, HEADS, DIM, TOPK, ratio, 1e-6, rope, candidate=candidate)
    for param in (indexer.wq_b, indexer.weights_proj, indexer.wk):
        param.data = torch.randn(param.shape, generator=gen) * 0.5
    indexer.k_norm.data = torch.rand(DIM, generator=gen) + 0.5
    return indexer


def test_module_keys_and_queries_follow_the_pipeline():
    indexer = _indexer(None, 0)
    gen = torch.Generator().manual_seed(1)
    latent, q_latent, x = (
        torch.randn(n, w, generator=gen) for n, w in ((6, LATENT), (4, Q_RANK), (4, HIDDEN))
    )
    keys = indexer.keys(latent, first_entry=3)
    k = latent @ indexer.wk.T
    k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + 1e-6) * indexer.k_norm
    k = indexer.rope(k.to(torch.bfloat16), torch.arange(3, 9) * 2)  # entry b starts at token 2b
    assert torch.equal(keys, fp4_round_trip(k))
    assert torch.equal(keys, fp4_round_trip(keys))  # already on the FP4 grid
    q, weights = indexer.queries(q_latent, x, torch.arange(4))
    assert q.shape == (4, HEADS, DIM) and torch.equal(q, fp4_round_trip(q))
    assert torch.equal(weights, (x @ indexer.weights_proj.T).to(torch.bfloat16))


def _batch(
    seed: int,
) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences: 2 entries (< one block, < top-k), 9 and 47 entries; queries at their ends."""
    gen = torch.Generator().manual_seed(seed)
    counts, keys, q_latents, xs, positions = [], [], [], [], []
    for entries, queries in ((2, 3), (9, 1), (47, 20)):
        last = 2 * entries - 1  # the query at position 2E - 1 completes entry E - 1
        counts.append(queries)
        keys.append(fp4_round_trip(torch.randn(entries, DIM, generator=gen)))
        q_latents.append(torch.randn(queries, Q_RANK, generator=gen))
        xs.append(torch.randn(queries, HIDDEN, generator=gen))
        positions.append(torch.arange(last - queries + 1, last + 1))
    return counts, keys, q_latents, xs, positions


def test_flattened_batch_equals_one_sequence_at_a_time():
    counts, keys, q_latents, xs, positions = _batch(5)
    q_all, x_all, pos_all = torch.cat(q_latents), torch.cat(xs), torch.cat(positions)
    source = _indexer(CandidateRole(True, 4, 4), 2)
    consumer = _indexer(CandidateRole(False, 4, 4), 3)
    plain = _indexer(None, 4)
    batched_source = source(q_all, x_all, pos_all, counts, keys)
    batched_consumer = consumer(q_all, x_all, pos_all, counts, keys, batched_source.candidates)
    batched_plain = plain(q_all, x_all, pos_all, counts, keys)
    assert batched_source.top.shape == (sum(counts), TOPK) and batched_source.candidates.shape == (
        sum(counts),
        4,
    )
    row = 0
    for count, seq_keys, q_latent, x, pos in zip(counts, keys, q_latents, xs, positions, strict=True):
        rows = slice(row, row + count)
        alone_source = source(q_latent, x, pos, [count], [seq_keys])
        assert torch.equal(batched_source.top[rows], alone_source.top)
        assert torch.equal(batched_source.candidates[rows], alone_source.candidates)
        alone = consumer(q_latent, x, pos, [count], [seq_keys], alone_source.candidates)
        assert torch.equal(batched_consumer.top[rows], alone.top)
        assert torch.equal(batched_plain.top[rows], plain(q_latent, x, pos, [count], [seq_keys]).top)
        # Entries a query picks are its own sequence's and complete; short sequences pad with -1.
        top = batched_plain.top[rows]
        assert ((top == -1) | ((top >= 0) & (top < visible_entries(pos, 2).unsqueeze(1)))).all()
        assert ((top >= 0).sum(1) == visible_entries(pos, 2).clamp(max=TOPK)).all()
        row += count


def test_consumer_needs_candidates_and_capacity():
    counts, keys, q_latents, xs, positions = _batch(6)
    consumer = _indexer(CandidateRole(False, 4, 4), 3)
    with pytest.raises(ValueError, match="candidate blocks for every query"):
        consumer(q_latents[0], xs[0], positions[0], counts[:1], keys[:1])
    with pytest.raises(ValueError, match="fewer than top_k"):
        _indexer(CandidateRole(False, 1, 4), 3)
    with pytest.raises(ValueError, match="keys were given"):
        select(
            torch.zeros(1, HEADS, DIM),
            torch.zeros(1, HEADS),
            torch.tensor([9]),
            [1],
            [torch.zeros(2, DIM)],
            2,
            4,
        )
    assert math.isfinite(float(index_scores(torch.zeros(1, 1, DIM), torch.ones(1, 1), torch.ones(1, DIM))))


def test_from_arch_gives_each_indexer_layer_its_role_and_weights():
    arch = DeepseekV41Arch.from_raw(tiny_config())
    rope = TrailingRope(arch.rope_head_dim, RopeSpec(theta=arch.compress_rope_theta, yarn=None))
    built = {layer: V41Indexer.from_arch(arch, layer, rope) for layer in (1, 2, 3, 5)}
    assert built[1].candidate is None and built[2].candidate is None
    assert built[3].candidate == CandidateRole(True, 8, 4)  # the source: dense top-k, makes blocks
    assert built[5].candidate == CandidateRole(False, 8, 4)
    assert [built[layer].wk is not None for layer in (1, 2, 3, 5)] == [True, False, True, False]
    assert (built[1].ratio, built[3].ratio, built[3].top_k) == (2, 1, arch.index_topk)
    assert built[1].wk.shape == (arch.index_head_dim, arch.head_dim)
    with pytest.raises(ValueError, match="layer 3's top-k"):
        V41Indexer.from_arch(arch, 4, rope)
    with pytest.raises(RuntimeError, match="borrows its index keys"):
        built[2].keys(torch.zeros(1, arch.head_dim), 0)
