"""DSpark, V4.1's draft layers, on a tiny random checkpoint (float32): the features, context window
and confidence head against DeepSeek's pure-PyTorch references, the whole draft step against a
dense implementation written here from the formulas, loading errors, greedy speculation that
gives exactly the target's greedy output, and what the confidences guarantee."""

from __future__ import annotations

import ast
import math
import tarfile
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.v41_config import DeepseekV41Arch
from deepinfer.model.deepseek_v4.v41_dspark import DSparkV41
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v4.v41_weights import load_v41_weights
from deepinfer.runner.sampler import SampledToken, SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.sequence import EngineRequest, Sequence
from deepinfer.speculative.dspark import DSparkProposer, draft
from deepinfer.speculative.proposer import DraftRequest
from deepinfer.step import ScheduledSequence, SchedulerOutput
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.reference import ENGINE_SDIST, reference_file
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config

_OPS = "deepinfer-0.1.0/deepinfer/model_executor/layers/tilelang_ops/"
TOL = 1e-5
K = 4  # drafts per block (the tiny config's dspark_block_size)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    return build_v41(tmp_path_factory.mktemp("v41_dspark") / "tiny", tiny_config(), seed=0)


@pytest.fixture(scope="module")
def models(tiny) -> tuple[DeepseekV41ForCausalLM, DSparkV41]:
    arch = DeepseekV41Arch.from_file(tiny.path)
    weights = load_v41_weights(tiny.path, arch)
    target = DeepseekV41ForCausalLM(arch, weights)
    return target, DSparkV41(arch, weights.tensors, target.embed.data, target.head.data)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, Callable]:
    """DeepSeek's `*_ref` functions, compiled from their files alone (the modules around them
    import their GPU kernel language)."""
    root = tmp_path_factory.mktemp("dspark_reference")
    wanted = {
        "dflash.py": {"confidence_head_fused_ref", "_sigmoid_with_temperature", "dflash_input_store_ref"},
        "get_kv_index.py": {"get_fused_dflash_get_input_ref"},
    }
    namespace: dict = {"torch": torch}
    with tarfile.open(reference_file(ENGINE_SDIST)) as tar:
        for name, functions in wanted.items():
            tar.extract(_OPS + name, root, filter="data")
            source = root / _OPS / name
            nodes = [
                n
                for n in ast.parse(source.read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name in functions
            ]
            assert {n.name for n in nodes} == functions
            exec(compile(ast.Module(body=nodes, type_ignores=[]), str(source), "exec"), namespace)
    return namespace


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _forward(
    target: DeepseekV41ForCausalLM, cache: ContiguousV41Cache, seq: int, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Feeds ids after the sequence's cached tokens -> (logits [n, vocab], features)."""
    start, n = cache.length(seq), ids.shape[0]
    layout = StepLayout((start,), (n,))
    features: dict[int, torch.Tensor] = {}
    hidden = target.forward_cached(
        ids, torch.arange(start, start + n), layout, cache.step([seq], layout), features
    )
    return target.compute_logits(hidden), features


def _context(drafter: DSparkV41, history: torch.Tensor, last_positions: list[int]) -> torch.Tensor:
    """[S, W, n * hidden] window rows of each sequence out of its feature history [S][T, n*hidden]."""
    positions, _ = drafter.window(torch.tensor(last_positions))
    return torch.stack([h[p] for h, p in zip(history, positions, strict=True)])


# -- against DeepSeek's references -----------------------------------------------------------------


def test_features_are_deepseeks_stream_mean(models, reference):
    """Each target layer's feature is DeepSeek's dflash_input_store_ref of the streams entering its
    attention (after Engram: layers 1 and 4 are Engram layers in the tiny model)."""
    target, drafter = models
    seen: dict[int, torch.Tensor] = {}
    for layer in drafter.spec.target_layer_ids:
        hc = target.layers[layer].hc_attn
        original = hc.forward_shifted

        def spy(streams, pre, layer=layer, original=original):
            seen[layer] = streams.clone()
            return original(streams, pre)

        hc.forward_shifted = spy
    try:
        cache = ContiguousV41Cache(target.arch)
        _, features = _forward(target, cache, cache.add_sequence(), _prompt(12, 0))
    finally:
        for layer in drafter.spec.target_layer_ids:
            del target.layers[layer].hc_attn.forward_shifted
    assert sorted(features) == [1, 4]
    for layer in drafter.spec.target_layer_ids:
        expected = torch.empty(12, target.arch.hidden_size)
        reference["dflash_input_store_ref"](seen[layer], expected)
        assert (features[layer] - expected).abs().max() < TOL
    assert drafter.target_features(features).shape == (12, 2 * target.arch.hidden_size)


def test_window_is_deepseeks_draft_kv_index(models, reference):
    """The context rows a block reads are DeepSeek's draft KV index minus the block's own slots
    (a ring as large as the positions, so a slot is its position)."""
    _, drafter = models
    window = drafter.arch.sliding_window
    accepted = torch.tensor([3, 20, 0, 9], dtype=torch.int32)  # last accepted target positions
    positions = torch.arange(64, dtype=torch.int32)
    kv_index = reference["get_fused_dflash_get_input_ref"](
        positions, positions, accepted.clone(), torch.zeros(4, dtype=torch.int32), 4096, K, window
    )[5].view(4, K, -1)
    ours, visible = drafter.window(accepted.long() + 1)  # the block starts after the accepted token
    for s in range(4):
        expected = kv_index[s, 0, :window]
        assert torch.equal(torch.where(visible[s], ours[s], -1), expected.long())
        block = kv_index[s, 0, window : window + K]
        assert torch.equal(block.long(), accepted[s] + 1 + torch.arange(K))
        assert (kv_index[s] == kv_index[s, :1]).all()  # every draft of the block reads the same rows


@pytest.mark.parametrize("temperature", [1.0, 0.85])
def test_confidence_head_is_deepseeks(models, reference, temperature, monkeypatch):
    _, drafter = models
    monkeypatch.setattr(drafter, "confidence_temperature", temperature)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, drafter.arch.hidden_size, generator=gen) * 3
    embedding, _ = drafter.markov(torch.randint(0, 96, (9,), generator=gen))
    weight = drafter.confidence_proj.t().contiguous()  # DeepSeek's [hidden + r, 1]
    expected = reference["confidence_head_fused_ref"](hidden, weight, temperature, embedding)
    assert (drafter.confidence(hidden, embedding, 0) - expected).abs().max() < TOL


# -- against the formulas ------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    out = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def _rope(x: torch.Tensor, position: float, inverse: bool = False) -> torch.Tensor:
    """Rotates the last 64 channels of x [..., D] pairwise (2i, 2i+1) by position / 10000^(2i/64)."""
    out = x.clone()
    tail = x.shape[-1] - 64
    for i in range(32):
        angle = position / 10000.0 ** (2 * i / 64) * (-1 if inverse else 1)
        a, b = x[..., tail + 2 * i], x[..., tail + 2 * i + 1]
        out[..., tail + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
        out[..., tail + 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
    return out


def _mixes(v: dict, key: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC: pre [N], post [N], comb [N, N] of one token's streams [N, D] (Sinkhorn, 20 rounds)."""
    n, eps = streams.shape[0], 1e-6
    mix = v[key + "_fn"] @ _rms(streams.flatten(), None)
    base, scale = v[key + "_base"], v[key + "_scale"]
    pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax((mix[2 * n :] * scale[2] + base[2 * n :]).view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(19):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return pre, post, comb


def _moe(v: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """One token: sqrt(softplus) scores, top-1 of score + bias (2 experts), weights normalized x 1.5,
    clamped SwiGLU experts plus the shared expert."""

    def swiglu(w: str, h: torch.Tensor) -> torch.Tensor:
        gate = (v[w + "w1.weight"] @ h).clamp(max=10.0)
        up = (v[w + "w3.weight"] @ h).clamp(-10.0, 10.0)
        return v[w + "w2.weight"] @ (F.silu(gate) * up)

    scores = F.softplus(v[prefix + "gate.weight"] @ x).sqrt()
    chosen = torch.topk(scores + v[prefix + "gate.bias"], 1).indices
    weights = scores[chosen] / scores[chosen].sum() * 1.5
    out = swiglu(prefix + "shared_experts.", x)
    for w, e in zip(weights, chosen.tolist(), strict=True):
        out = out + w * swiglu(f"{prefix}experts.{e}.", x)
    return out


def _dense_draft(
    v: dict, features: torch.Tensor, last: int, p: int, shifted: bool
) -> tuple[list[int], list[float]]:
    """One sequence's greedy drafts and confidences from the formulas, position by position:
    features [W, 2 * 64] of positions p - 8 .. p - 1, last token `last` at p. Shifted mHC: a
    sub-layer collapses the streams with the previous one's pre weights (stream 0 first, the
    last one's at the end); plain: with its own, and the hyper head at the end."""
    heads, dim, window, noise = 4, 96, 8, 5
    ctx = [(i, p - window + i) for i in range(window) if p - window + i >= 0]
    main = [_rms(v["mtp.0.main_proj.weight"] @ features[i], v["mtp.0.main_norm.weight"]) for i, _ in ctx]
    tokens = [last] + [noise] * (K - 1)
    streams = [v["embed.weight"][t].expand(2, -1).clone() for t in tokens]  # [N, D] per position
    carried = [torch.tensor([1.0, 0.0]) for _ in tokens]  # shifted mHC: stream 0 first
    for d in range(2):
        a = f"mtp.{d}.attn."

        def key(x: torch.Tensor, pos: int, a: str = a) -> torch.Tensor:
            return _rope(_rms(v[a + "wkv.weight"] @ x, v[a + "kv_norm.weight"]), pos)

        mixed = [_mixes(v, f"mtp.{d}.hc_attn", s) for s in streams]
        attn_pre = carried if shifted else [m[0] for m in mixed]
        x = [_rms(attn_pre[j] @ streams[j], v[f"mtp.{d}.attn_norm.weight"]) for j in range(K)]
        keys = [key(m, pos) for m, (_, pos) in zip(main, ctx, strict=True)] + [
            key(x[j], p + j) for j in range(K)
        ]
        keys = torch.stack(keys)  # every block position sees the context and the whole block
        new = []
        for j in range(K):
            q = v[a + "wq_b.weight"] @ _rms(v[a + "wq_a.weight"] @ x[j], v[a + "q_norm.weight"])
            q = _rope(q.view(heads, dim), p + j)
            outs = []
            for h in range(heads):
                logits = keys @ q[h] / math.sqrt(dim)
                e = torch.exp(logits)
                probs = e / (e.sum() + torch.exp(v[a + "attn_sink"][h]))
                outs.append(_rope(probs @ keys, p + j, inverse=True))
            groups = [torch.cat(outs[:2]), torch.cat(outs[2:])]
            wo_a = v[a + "wo_a.weight"].view(2, 16, -1)
            out = v[a + "wo_b.weight"] @ torch.cat([wo_a[g] @ groups[g] for g in range(2)])
            _, post, comb = mixed[j]
            new.append(post.unsqueeze(1) * out + comb.t() @ streams[j])
        streams = new
        mixed_ffn = [_mixes(v, f"mtp.{d}.hc_ffn", s) for s in streams]
        ffn_pre = [m[0] for m in (mixed if shifted else mixed_ffn)]
        new = []
        for j in range(K):
            h = _rms(ffn_pre[j] @ streams[j], v[f"mtp.{d}.ffn_norm.weight"])
            _, post, comb = mixed_ffn[j]
            new.append(post.unsqueeze(1) * _moe(v, f"mtp.{d}.ffn.", h) + comb.t() @ streams[j])
        streams = new
        carried = [m[0] for m in mixed_ffn]
    drafts, confidences, previous = [], [], last
    for j in range(K):
        if not shifted:
            mix = v["mtp.1.hc_head_fn"] @ _rms(streams[j].flatten(), None)
            carried[j] = torch.sigmoid(mix * v["mtp.1.hc_head_scale"][0] + v["mtp.1.hc_head_base"]) + 1e-6
        h = carried[j] @ streams[j]
        m = v["mtp.1.markov_head.embed.weight"][previous]
        logits = v["head.weight"] @ _rms(h, v["mtp.1.norm.weight"]) + v["mtp.1.markov_head.head.weight"] @ m
        z = v["mtp.1.confidence_head.proj.weight"][0] @ torch.cat((h, m))
        confidences.append(float(1 / (1 + torch.exp(-z))))
        previous = int(logits.argmax())
        drafts.append(previous)
    return drafts, confidences


def _check_draft_step(tiny: TinyV41, target: DeepseekV41ForCausalLM, drafter: DSparkV41) -> None:
    """Two sequences, one with a window reaching before position 0 (rows masked), one full."""
    history, lasts, ps = [], [], []
    for n, seed in ((5, 1), (15, 2)):
        cache = ContiguousV41Cache(target.arch)
        logits, features = _forward(target, cache, cache.add_sequence(), _prompt(n, seed))
        history.append(drafter.target_features(features))
        lasts.append(int(logits[-1].argmax()))
        ps.append(n)
    context = _context(drafter, history, ps)
    tokens, confidences = draft(drafter, context, torch.tensor(lasts), torch.tensor(ps), K)
    for s in range(2):
        dense = _dense_draft(tiny.values, context[s], lasts[s], ps[s], target.arch.hc_shifted)
        assert tokens[s].tolist() == dense[0]
        assert (confidences[s] - torch.tensor(dense[1])).abs().max() < TOL
    assert len(set(tokens.flatten().tolist())) > 2  # not degenerate


def test_draft_step_equals_the_formulas(tiny, models):
    _check_draft_step(tiny, *models)


def test_draft_step_with_plain_mhc_equals_the_formulas(tmp_path):
    """Unshifted hyper-connections: each sub-layer mixes with its own pre weights, and the last
    draft layer's hyper head (`mtp.1.hc_head_*`) collapses the streams."""
    tiny = build_v41(tmp_path / "plain", tiny_config(hc_shifted=False), seed=1)
    arch = DeepseekV41Arch.from_file(tiny.path)
    weights = load_v41_weights(tiny.path, arch)
    target = DeepseekV41ForCausalLM(arch, weights)
    drafter = DSparkV41(arch, weights.tensors, target.embed.data, target.head.data)
    assert drafter.hc_head is not None
    _check_draft_step(tiny, target, drafter)


def test_confidence_temperature_per_position(tiny, models):
    target, drafter = models
    tensors = load_v41_weights(tiny.path, drafter.arch).tensors
    with pytest.raises(ValueError, match="confidence_temperature: 3 values for a block of 4 drafts"):
        DSparkV41(drafter.arch, tensors, target.embed.data, target.head.data, (1.0, 0.5, 2.0))
    scaled = DSparkV41(drafter.arch, tensors, target.embed.data, target.head.data, (1.0, 0.5, 2.0, 1.0))
    hidden = torch.randn(3, drafter.arch.hidden_size, generator=torch.Generator().manual_seed(2))
    embedding, _ = drafter.markov(torch.tensor([4, 5, 6]))
    z = torch.logit(drafter.confidence(hidden, embedding, 0))  # temperature 1: the raw logit
    for position, temperature in enumerate((1.0, 0.5, 2.0, 1.0)):
        assert (
            scaled.confidence(hidden, embedding, position) - torch.sigmoid(z / temperature)
        ).abs().max() < TOL


# -- loading -----------------------------------------------------------------------------------------


def test_loading_errors_name_the_tensor(tiny, models):
    target, drafter = models
    arch = drafter.arch
    tensors = load_v41_weights(tiny.path, arch).tensors
    for name in (
        "mtp.1.confidence_head.proj.weight",
        "mtp.0.main_proj.weight",
        "mtp.0.ffn.experts.1.w2.weight",
    ):
        broken = dict(tensors)
        del broken[name]
        with pytest.raises(ValueError, match=f"{name}: DSpark tensor missing"):
            DSparkV41(arch, broken, target.embed.data, target.head.data)
    broken = dict(tensors)
    broken["mtp.1.markov_head.embed.weight"] = torch.zeros(96, 7)
    with pytest.raises(
        ValueError, match=r"mtp\.1\.markov_head\.embed\.weight: shape \(96, 7\), DSpark expects \(96, 8\)"
    ):
        DSparkV41(arch, broken, target.embed.data, target.head.data)
    loaded = DSparkV41(arch, tensors, target.embed.data, target.head.data)
    assert torch.equal(loaded.markov_embed, tensors["mtp.1.markov_head.embed.weight"])
    assert torch.equal(loaded.layers[0].ffn.experts.w2[1], tensors["mtp.0.ffn.experts.1.w2.weight"])


# -- speculation -------------------------------------------------------------------------------------


def _greedy(target: DeepseekV41ForCausalLM, prompt: torch.Tensor, count: int) -> list[int]:
    cache = ContiguousV41Cache(target.arch)
    seq = cache.add_sequence()
    logits, _ = _forward(target, cache, seq, prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < count:
        logits, _ = _forward(target, cache, seq, torch.tensor(out[-1:]))
        out.append(int(logits[-1].argmax()))
    return out


def _speculate(
    target: DeepseekV41ForCausalLM,
    drafter: DSparkV41,
    prompt: torch.Tensor,
    count: int,
    propose: Callable[[list[int], torch.Tensor, int], list[int]],
) -> tuple[list[int], int]:
    """Greedy speculation: the target verifies [last, drafts] in one forward, accepts drafts while
    they equal its argmax, adds its own next token, and rolls its cache back past the rejected
    drafts. -> (the first `count` output tokens, drafts accepted)."""
    cache = ContiguousV41Cache(target.arch)
    seq = cache.add_sequence()
    logits, features = _forward(target, cache, seq, prompt)
    history = drafter.target_features(features)  # [positions so far, 2 * hidden]
    out, accepted = [int(logits[-1].argmax())], 0
    while len(out) < count:
        p = cache.length(seq)  # the last token's position
        drafts = propose(out, history, p)
        logits, features = _forward(target, cache, seq, torch.tensor([out[-1], *drafts]))
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        accepted += n
        out += [*drafts[:n], best[n]]
        cache.truncate(seq, p + 1 + n)
        history = torch.cat((history, drafter.target_features(features)[: 1 + n]))
    return out[:count], accepted


def _oracle(expected: list[int]) -> Callable[[list[int], torch.Tensor, int], list[int]]:
    """Drafts the target's own continuation with the third draft wrong: the acceptance path runs."""

    def propose(out: list[int], history: torch.Tensor, p: int) -> list[int]:
        right = expected[len(out) : len(out) + K]
        return right[:2] + [(t + 1) % 96 for t in right[2:]] if len(right) == K else right

    return propose


def test_greedy_speculation_gives_the_targets_greedy_output(models):
    target, drafter = models

    def dspark(out: list[int], history: torch.Tensor, p: int) -> list[int]:
        tokens, _ = draft(
            drafter, _context(drafter, [history], [p]), torch.tensor(out[-1:]), torch.tensor([p]), K
        )
        return tokens[0].tolist()

    for seed, n in ((3, 11), (4, 17)):
        prompt = _prompt(n, seed)
        expected = _greedy(target, prompt, 32)
        got, _ = _speculate(target, drafter, prompt, 32, dspark)
        assert got == expected

        got, accepted = _speculate(target, drafter, prompt, 32, _oracle(expected))
        assert got == expected and accepted >= 16


# -- confidences ---------------------------------------------------------------------------------------


def test_confidences_are_probabilities_that_ignore_their_own_draft(models):
    """In [0, 1] (products P_j non-increasing along a sequence), and c_j is a function of the
    hidden state and the drafts before j only: forcing draft j to another token leaves c_j as it is
    (so a sampled draft's confidence never looked at its own draw) and moves c_(j+1) through the
    Markov embedding."""
    target, drafter = models
    cache = ContiguousV41Cache(target.arch)
    logits, features = _forward(target, cache, cache.add_sequence(), _prompt(14, 5))
    context = _context(drafter, [drafter.target_features(features)], [14])
    last, p = torch.tensor([int(logits[-1].argmax())]), torch.tensor([14])
    tokens, confidences = draft(drafter, context, last, p, K)
    assert ((confidences > 0) & (confidences < 1)).all()
    products = confidences.cumprod(dim=1)
    assert (products[:, 1:] <= products[:, :-1]).all()
    gen = torch.Generator().manual_seed(0)
    sampled, sampled_conf = draft(drafter, context, last, p, K, temperature=1.0, generator=gen)
    assert (sampled_conf[0, 0] - confidences[0, 0]).abs() < TOL  # c_1 reads only the last token
    for j in range(1, K):
        if sampled[0, j - 1] != tokens[0, j - 1] and torch.equal(sampled[0, : j - 1], tokens[0, : j - 1]):
            # The first differing draft: c up to j is the same, c_(j+1) follows the new draft.
            assert (sampled_conf[0, :j] - confidences[0, :j]).abs().max() < TOL
            assert (sampled_conf[0, j] - confidences[0, j]).abs() > 1e-4
            break
    else:
        pytest.fail("the sampled drafts never left the greedy ones: pick another seed")
    # Directly: the head sees [h_j, markov_embed[draft j - 1]], and each previous token moves it.
    hidden = drafter.block_hidden(
        last, p, drafter.context_keys(context, drafter.window(p)[0]), drafter.window(p)[1], K
    )
    values = [
        float(drafter.confidence(hidden[:, 1], drafter.markov(torch.tensor([t]))[0], 1)) for t in range(96)
    ]
    assert len({round(c, 6) for c in values}) > 48


# -- the proposer --------------------------------------------------------------------------------------


def _decode_item(seq: Sequence, k: int) -> ScheduledSequence:
    return ScheduledSequence(seq, 1 + k, len(seq.token_ids) - 1, True, num_draft_tokens=k, speculative=True)


def _request(seq: Sequence, item: ScheduledSequence, params: SamplingParams, seed: int = 0) -> DraftRequest:
    outputs = seq.token_ids[seq.num_prompt_tokens :]
    row = SamplingRow(params, seq.token_ids[: seq.num_prompt_tokens], outputs)
    row.generator = torch.Generator().manual_seed(seed)
    return DraftRequest(item, row, [])


def test_proposer_drafts_what_draft_does_and_speculation_stays_exact(models):
    """Through the Proposer interface (features handed in after_step, as the runner would): each
    round drafts exactly draft()'s tokens and head confidences from the kept window, and greedy
    verification of them gives the target's greedy output."""
    target, drafter = models
    proposer = DSparkProposer(drafter)
    prompt = _prompt(13, 6).tolist()
    greedy = SamplingParams(temperature=0.0)
    seq = Sequence(1, EngineRequest("r", prompt, greedy), 0, list(prompt), len(prompt), b"")
    cache = ContiguousV41Cache(target.arch)
    handle = cache.add_sequence()
    logits, features = _forward(target, cache, handle, torch.tensor(prompt))
    history = drafter.target_features(features)
    seq.token_ids.append(int(logits[-1].argmax()))
    prefill = ScheduledSequence(seq, len(prompt), 0, True)
    proposer.after_step([prefill], history, [0], {1: [SampledToken(seq.token_ids[-1])]})
    while len(seq.token_ids) - len(prompt) < 32:
        item = _decode_item(seq, K)
        request = _request(seq, item, greedy)
        proposer.propose(SchedulerOutput([item], [], []), [request])
        p = item.start
        tokens, confidences = draft(
            drafter, _context(drafter, [history], [p]), torch.tensor([seq.token_ids[p]]), torch.tensor([p]), K
        )
        assert request.token_ids == tokens[0].tolist()
        assert (
            max(abs(a - b) for a, b in zip(request.confidences, confidences[0].tolist(), strict=True)) < TOL
        )
        logits, features = _forward(
            target, cache, handle, torch.tensor([seq.token_ids[p], *request.token_ids])
        )
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < K and request.token_ids[n] == best[n]:
            n += 1
        new = [*request.token_ids[:n], best[n]]
        seq.token_ids += new
        cache.truncate(handle, p + 1 + n)
        step_features = drafter.target_features(features)
        history = torch.cat((history, step_features[: 1 + n]))
        proposer.after_step([item], step_features, [0], {1: [SampledToken(t) for t in new]})
    assert seq.token_ids[len(prompt) : len(prompt) + 32] == _greedy(target, torch.tensor(prompt), 32)


def test_proposer_sampled_drafts_carry_q_and_the_heads_confidence(models):
    """A sampled request gets q with each draft and the head's confidence (not sum q^2); a
    sequence whose features stop short of its last token drafts nothing."""
    target, drafter = models
    proposer = DSparkProposer(drafter)
    prompt = _prompt(10, 7).tolist()
    sampled = SamplingParams(temperature=0.8)
    seq = Sequence(1, EngineRequest("r", prompt, sampled), 0, [*prompt, 9], len(prompt), b"")
    cache = ContiguousV41Cache(target.arch)
    _, features = _forward(target, cache, cache.add_sequence(), torch.tensor(prompt))
    history = drafter.target_features(features)
    proposer.after_step([ScheduledSequence(seq, len(prompt), 0, True)], history, [0], {1: [SampledToken(9)]})
    item = _decode_item(seq, K)
    request = _request(seq, item, sampled, seed=3)
    proposer.propose(SchedulerOutput([item], [], []), [request])
    assert len(request.token_ids) == K and len(request.probs) == K
    tokens = torch.tensor([request.token_ids])
    context = _context(drafter, [history], [item.start])
    positions, visible = drafter.window(torch.tensor([item.start]))
    hidden = drafter.block_hidden(
        torch.tensor([9]), torch.tensor([item.start]), drafter.context_keys(context, positions), visible, K
    )
    previous = torch.cat((torch.tensor([9]), tokens[0, :-1]))
    expected = [
        float(drafter.confidence(hidden[:, j], drafter.markov(previous[j : j + 1])[0], j)) for j in range(K)
    ]
    assert max(abs(a - b) for a, b in zip(request.confidences, expected, strict=True)) < TOL
    assert all(abs(c - float(q @ q)) > 1e-4 for c, q in zip(request.confidences, request.probs, strict=True))
    behind = Sequence(2, EngineRequest("s", prompt, sampled), 0, [*prompt, 9, 9], len(prompt), b"")
    proposer.after_step(
        [ScheduledSequence(behind, len(prompt), 0, True)], history, [0], {2: [SampledToken(9)]}
    )
    late = _request(behind, _decode_item(behind, K), sampled)  # its features end one token early
    proposer.propose(SchedulerOutput([late.item], [], []), [late])
    assert late.token_ids == [] and late.stopped
    curve = proposer.profile_round(2, 1)  # seconds per draft position of a round of 1, 2 sequences
    assert curve.counts == [1, 2] and all(t > 0 for t in curve.seconds)
