"""The DeepSeek-V4.1 model over its contiguous cache, on tiny random checkpoints (float32):
whole prompt = token by token = chunks (and a batch = each sequence alone, a rollback = never
having seen the rolled-back tokens), its sliding block equals V4's where the two agree, and
Engram, the sharing maps and YoCo's shared hidden each change what they should."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer.model.deepseek_v4 import attention as v4_attention
from deepinfer.model.deepseek_v4 import model as deepseek_v4
from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.config import DeepseekV4Arch
from deepinfer.model.deepseek_v4.rotary import TrailingRope
from deepinfer.model.deepseek_v4.v41_attention import CrossLayer
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM, rope_specs
from tests.deepseek_v4.oracle_cache import ContiguousV4Cache
from tests.deepseek_v4.tiny_v4 import tiny_config as tiny_v4_config
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.tiny_v41 import build_v41, tiny_config

PROMPT = 40  # > the window (8): 40 C1 entries in 10 candidate blocks (8 kept), 20 C2 entries
TOL = 1e-4


def _model(root: Path, name: str, **overrides: Any) -> DeepseekV41ForCausalLM:
    path = root / name
    build_v41(path, tiny_config(**overrides), seed=0)
    return DeepseekV41ForCausalLM.from_pretrained(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> DeepseekV41ForCausalLM:
    return _model(tmp_path_factory.mktemp("v41_model"), "tiny")


def _prompt(n: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _run(
    model: DeepseekV41ForCausalLM,
    ids: torch.Tensor,
    chunks: list[int],
    cache: ContiguousV41Cache | None = None,
) -> torch.Tensor:
    """Logits [sum(chunks), vocab] of one new sequence fed chunk by chunk."""
    cache = cache or ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    return torch.cat([_step(model, cache, seq, ids, n) for n in chunks])


def _step(
    model: DeepseekV41ForCausalLM, cache: ContiguousV41Cache, seq: int, ids: torch.Tensor, n: int
) -> torch.Tensor:
    """The next n tokens of `ids` for sequence `seq` -> their logits [n, vocab]."""
    start = cache.length(seq)
    layout = StepLayout((start,), (n,))
    hidden = model.forward_cached(
        ids[start : start + n], torch.arange(start, start + n), layout, cache.step([seq], layout)
    )
    return model.compute_logits(hidden)


def test_loads_and_runs(model):
    arch = model.arch
    assert arch.compress_ratios == (0, 2, 2, 1, 1, 1) and arch.yoco_boundary == 3
    assert [layer.engram is not None for layer in model.layers] == [False, True, False, False, True, False]
    owners = [(a.compressor is not None, a.indexer is not None) for a in (b.attn for b in model.layers)]
    assert owners == [
        (False, False),
        (True, True),
        (False, True),
        (True, True),
        (False, False),
        (False, True),
    ]
    logits = _run(model, _prompt(12), [12])
    assert logits.shape == (12, arch.vocab_size) and torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1e-2  # not degenerate: the comparisons below mean something


def test_whole_prompt_equals_token_by_token_and_chunks(model):
    ids = _prompt()
    whole = _run(model, ids, [PROMPT])
    assert (whole - _run(model, ids, [1] * PROMPT)).abs().max() < TOL
    assert (whole - _run(model, ids, [7] * 5 + [5])).abs().max() < TOL


def test_plain_mhc_and_a_kv_source_past_the_boundary_too(tmp_path):
    """Unshifted mHC (the hyper head), and layer 5 compressing the YoCo shared hidden."""
    model = _model(
        tmp_path, "plain", hc_shifted=False, kv_source_layer_ids=[1, 3, 5], index_k_source_layer_ids=[1, 3, 5]
    )
    assert model.hc_head is not None and model.layers[5].attn.compresses_shared_hidden
    ids = _prompt()
    whole = _run(model, ids, [PROMPT])
    assert (whole - _run(model, ids, [1] * PROMPT)).abs().max() < TOL
    assert (whole - _run(model, ids, [7] * 5 + [5])).abs().max() < TOL


def test_a_batch_equals_each_sequence_alone(model):
    ids = [_prompt(23, seed=1), _prompt(30, seed=2)]
    alone = [_run(model, s, [10, len(s) - 10]) for s in ids]
    cache = ContiguousV41Cache(model.arch)
    seqs = [cache.add_sequence() for _ in ids]
    for s, seq in zip(ids, seqs, strict=True):  # different lengths before the shared step
        _step(model, cache, seq, s, 10 if seq == seqs[0] else 16)
    starts = tuple(cache.length(seq) for seq in seqs)
    lens = tuple(len(s) - start for s, start in zip(ids, starts, strict=True))
    layout = StepLayout(starts, lens)
    flat = torch.cat([s[start:] for s, start in zip(ids, starts, strict=True)])
    positions = torch.cat([torch.arange(start, len(s)) for s, start in zip(ids, starts, strict=True)])
    batched = model.compute_logits(model.forward_cached(flat, positions, layout, cache.step(seqs, layout)))
    first, second = batched.split(lens)
    assert (first - alone[0][starts[0] :]).abs().max() < TOL
    assert (second - alone[1][starts[1] :]).abs().max() < TOL


def test_rolled_back_tokens_leave_no_trace(model):
    ids, draft = _prompt(), _prompt(seed=3)
    cache = ContiguousV41Cache(model.arch, backtrack=3)
    seq = cache.add_sequence()
    _step(model, cache, seq, ids, 25)  # ends inside a C2 block: its first token is in the ring
    _step(model, cache, seq, torch.cat((ids[:25], draft[25:28])), 3)  # three wrong drafts
    cache.truncate(seq, 25)
    resumed = _step(model, cache, seq, ids, PROMPT - 25)
    assert (resumed - _run(model, ids, [PROMPT])[25:]).abs().max() < TOL
    with pytest.raises(ValueError, match="backtrack"):
        cache.truncate(seq, 36)


def test_sliding_block_equals_v4s_without_its_query_norm(tmp_path, monkeypatch):
    """A V4.1 model cannot be written as a V4 one: V4.1 needs a C1 layer (its YoCo boundary), and
    its C1 / C2 compression (no position bias, no overlap, index keys projected from the main
    entries) is not V4's CSA / HCA at 4 / 128 (position biases, CSA's overlapping windows and its
    indexer's own compressor). What they share is the sliding-window block with plain mHC and the
    MoE: the same weights give the same block, once V4's per-head query RMS norm, which DeepSeek
    runs V4.1 without (`use_qnorm` off), is taken out."""
    v41 = _model(tmp_path, "plain", hc_shifted=False, engram_layer_ids=[])
    block41 = v41.layers[0]
    raw = tiny_v4_config(
        96,
        num_hidden_layers=1,
        head_dim=96,
        partial_rotary_factor=None,
        qk_rope_head_dim=64,
        layer_types=["sliding_attention"],
        mlp_layer_types=["moe"],
        index_head_dim=64,
        hc_mult=2,
        n_routed_experts=4,
        swiglu_limit=10.0,
        num_nextn_predict_layers=0,
    )
    arch4 = DeepseekV4Arch.from_raw(raw)
    assert arch4.main_rope == rope_specs(v41.arch)[0]
    main_rope = TrailingRope(arch4.rope_head_dim, arch4.main_rope)
    block4 = deepseek_v4.V4Block(arch4, 0, main_rope, TrailingRope(arch4.rope_head_dim, arch4.compress_rope))
    block4.load_state_dict(block41.state_dict(), strict=True)  # the same parameters, by name

    gen = torch.Generator().manual_seed(4)
    streams = torch.randn(20, 2, 64, generator=gen)
    ids = _prompt(20)

    def v4_output() -> torch.Tensor:
        cache = ContiguousV4Cache(deepseek_v4.cache_declarations(arch4), torch.float32, torch.device("cpu"))
        seq, outs = cache.add_sequence(), []
        for start, n in ((0, 13), (13, 7)):
            layout = StepLayout((start,), (n,))
            rows = slice(start, start + n)
            positions = torch.arange(start, start + n)
            outs.append(block4(streams[rows], ids[rows], positions, layout, cache.step([seq], layout)))
        return torch.cat(outs)

    cache41 = ContiguousV41Cache(v41.arch)
    seq, outs = cache41.add_sequence(), []
    for start, n in ((0, 13), (13, 7)):
        layout = StepLayout((start,), (n,))
        rows = slice(start, start + n)
        step = cache41.step([seq], layout)
        out, _ = block41(
            streams[rows], None, ids[rows], torch.arange(start, start + n), layout, step, CrossLayer(), None
        )
        step.finish(ids[rows])
        outs.append(out)
    out41 = torch.cat(outs)
    assert (v4_output() - out41).abs().max() > 1e-3  # V4 normalizes each query head
    monkeypatch.setattr(v4_attention, "unweighted_rms_norm", lambda x, eps: x)
    assert (v4_output() - out41).abs().max() < 1e-5


def test_a_step_must_continue_its_sequences(model):
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    _step(model, cache, seq, _prompt(), 5)
    with pytest.raises(ValueError, match="not at position 4"):
        cache.step([seq], StepLayout((4,), (1,)))
    layout = StepLayout((5,), (2,))
    with pytest.raises(ValueError, match="consecutively"):
        model.forward_cached(_prompt(2), torch.tensor([5, 7]), layout, cache.step([seq], layout))
    with pytest.raises(ValueError, match="truncate a sequence of 5 tokens to 6"):
        cache.truncate(seq, 6)


def test_engram_changes_the_output(model):
    ids = _prompt()
    with_engram = _run(model, ids, [PROMPT])
    engrams = {i: layer.engram for i, layer in enumerate(model.layers) if layer.engram is not None}
    try:
        for i in engrams:
            model.layers[i].engram = None
        without = _run(model, ids, [PROMPT])
    finally:
        for i, engram in engrams.items():
            model.layers[i].engram = engram
    assert (with_engram - without).abs().max() > 1e-3


class _Capture:
    """The arguments and output of one layer's attention in the last step."""

    def __init__(self, model: DeepseekV41ForCausalLM, layer: int) -> None:
        self.args: tuple = ()
        self.shared = CrossLayer()
        self.output = torch.empty(0)
        attn = model.layers[layer].attn
        attn.register_forward_pre_hook(self._before)
        attn.register_forward_hook(lambda module, args, output: setattr(self, "output", output))

    def _before(self, module, args) -> None:
        self.args = args
        shared = args[4]  # what the layer finds: its sources' values
        self.shared = CrossLayer(shared.shared_hidden, shared.pre_rope, shared.top, shared.candidates)


def _decode_last_and_rewind(model, layer: int) -> tuple[_Capture, ContiguousV41Cache, int]:
    """Prefill PROMPT - 1 tokens, decode the last one capturing `layer`, then roll it back."""
    capture = _Capture(model, layer)
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    ids = _prompt()
    _step(model, cache, seq, ids, PROMPT - 1)
    _step(model, cache, seq, ids, 1)
    cache.truncate(seq, PROMPT - 1)
    return capture, cache, seq


def _rerun(model, layer: int, capture: _Capture, cache, seq, shared: CrossLayer, edit=None) -> torch.Tensor:
    """The captured attention call again on the rewound cache, `edit(step)` applied first."""
    x, positions, layout, _, _ = capture.args
    step = cache.step([seq], layout)
    if edit is not None:
        edit(step)
    return model.layers[layer].attn(x, positions, layout, step, shared)


def test_a_consumer_reads_its_sources_compressed_kv_and_top_k(tmp_path):
    model = _model(tmp_path, "kv")  # layer 4: layer 3's compressed KV and top-k, nothing of its own
    capture, cache, seq = _decode_last_and_rewind(model, 4)
    assert capture.shared.top is not None
    same = _rerun(model, 4, capture, cache, seq, capture.shared)
    assert torch.equal(same, capture.output)
    no_top = CrossLayer(top=torch.full_like(capture.shared.top, -1))
    assert (_rerun(model, 4, capture, cache, seq, no_top) - same).abs().max() > 1e-4
    zeros = torch.zeros(PROMPT, model.arch.head_dim)  # layer 3 (C1) holds one entry per token
    zeroed = _rerun(
        model, 4, capture, cache, seq, capture.shared, lambda step: step.write_entries(0, 3, 0, zeros)
    )
    assert (zeroed - same).abs().max() > 1e-4


def test_an_indexer_reads_its_index_k_sources_keys(tmp_path):
    model = _model(tmp_path, "index_k")  # layer 2: own indexer, layer 1's index keys
    capture, cache, seq = _decode_last_and_rewind(model, 2)
    shared = CrossLayer()
    same = _rerun(model, 2, capture, cache, seq, shared)
    assert torch.equal(same, capture.output)
    picked = shared.top.clone()
    other = CrossLayer()
    keys = -cache.step([seq], capture.args[2]).index_keys(0, 1)  # every score changes sign
    changed = _rerun(model, 2, capture, cache, seq, other, lambda step: step.write_index_keys(0, 1, 0, keys))
    assert not torch.equal(other.top, picked)
    assert (changed - same).abs().max() > 1e-4


def test_kv_sources_past_the_yoco_boundary_compress_the_shared_hidden(tmp_path):
    model = _model(tmp_path, "yoco", kv_source_layer_ids=[1, 3, 5], index_k_source_layer_ids=[1, 3, 5])
    attn5 = model.layers[5].attn
    assert attn5.compresses_shared_hidden and not model.layers[3].attn.compresses_shared_hidden
    boundary_input = _Capture(model, 3)
    own_input = _Capture(model, 5)
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    _step(model, cache, seq, _prompt(), PROMPT)
    positions = torch.arange(PROMPT)
    stored = cache.step([seq], StepLayout((PROMPT,), (0,))).entries(0, 5, positions)

    def entries(x: torch.Tensor) -> torch.Tensor:
        return attn5.rope(attn5.compressor(x, 0, None), positions)

    shared_hidden = boundary_input.args[0]
    assert torch.allclose(stored, entries(shared_hidden), atol=1e-6)
    assert (stored - entries(own_input.args[0])).abs().max() > 1e-3


def test_sparse_attention_equals_the_formula_query_by_query(tmp_path):
    """Layer 5 (C1, own indexer inside layer 3's candidate blocks, layer 3's compressed KV) over
    a whole prompt: each query's output from its window and its picked entries, one at a time."""
    model = _model(tmp_path, "formula")
    attn, arch = model.layers[5].attn, model.arch
    capture = _Capture(model, 5)
    picks: list[torch.Tensor] = []
    attn.register_forward_hook(lambda module, args, output: picks.append(args[4].top.clone()))
    cache = ContiguousV41Cache(arch)
    seq = cache.add_sequence()
    _step(model, cache, seq, _prompt(), PROMPT)
    x, positions = capture.args[0], capture.args[1]
    top = picks[-1]
    assert ((top >= 0).sum(1) == (positions + 1).clamp(max=arch.index_topk)).all()
    entries = cache.step([seq], StepLayout((PROMPT,), (0,))).entries(0, 3, torch.arange(PROMPT))
    q = attn.q_norm(x @ attn.wq_a.T) @ attn.wq_b.T
    q = attn.rope(q.view(PROMPT, arch.num_heads, arch.head_dim), positions)
    kv = attn.rope(attn.kv_norm(x @ attn.wkv.T), positions)
    out = torch.zeros_like(q)
    for i, p in enumerate(positions.tolist()):
        window = kv[max(0, p - arch.sliding_window + 1) : p + 1]
        keys = torch.cat((window, entries[top[i][top[i] >= 0]]))
        for h in range(arch.num_heads):
            logits = keys @ q[i, h] * arch.head_dim**-0.5
            weights = logits.exp() / (logits.exp().sum() + attn.attn_sink[h].exp())
            out[i, h] = weights @ keys
    out = attn.rope(out, positions, inverse=True)
    group = arch.num_heads // arch.o_groups
    down = torch.cat(
        [
            out[:, g * group : (g + 1) * group].flatten(1)
            @ attn.wo_a[g * arch.o_lora_rank : (g + 1) * arch.o_lora_rank].T
            for g in range(arch.o_groups)
        ],
        dim=1,
    )
    assert (down @ attn.wo_b.T - capture.output).abs().max() < 1e-5
