"""DSpark through the engine (`speculative_method="dspark"`) on the tiny V4.1 of test_engine.py.

Greedy output equals plain decoding with fixed, dynamic and confidence-scheduled lengths,
batched and in prefill chunks, and no block stays allocated; with drafts forced to the right
tokens for a varying prefix (the random tiny drafter is almost never right), accepted drafts and
the rollback of the rest keep it so. Sampled output through the verifier follows the target's
distribution (chi-square, the helper of tests/speculative/test_verifier.py). The confidence
policy, fed DSpark's real confidences, verifies exactly the lengths an exhaustive search finds
best on a synthetic cost curve (the hand-computed optimum on synthetic confidences is
tests/speculative/test_confidence_policy.py::test_the_hand_computed_optimum).
"""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError
from deepinfer.speculative import dspark
from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from deepinfer.speculative.dspark import DSparkProposer
from deepinfer.speculative.proposer import draw_drafts
from tests.deepseek.tiny_checkpoint import build_tokenizer, deepseek_config
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.test_engine import (
    WINDOW,
    _blocks_in_use,
    _greedy,
    _llm,
    _prompts,
    _standalone_logits,
)
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config
from tests.speculative.test_confidence_policy import brute_force
from tests.speculative.test_verifier import chi_square_pvalue

SAMPLED_TRIALS = 600
TOP_K = 2  # sampled drafts and targets over 2 tokens a position: 8 cells for 3 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyV41:
    path = tmp_path_factory.mktemp("v41_dspark_engine")
    vocab = build_tokenizer(path)
    return build_v41(path, tiny_config(vocab_size=vocab, sliding_window=WINDOW), seed=4)


@pytest.fixture(scope="module")
def plain(tiny) -> LLM:
    return _llm(tiny)


@pytest.fixture(scope="module")
def reference(tiny, plain) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts over several windows, and their plain greedy continuations."""
    prompts = _prompts(tiny, [5, 23, 41, 9])
    return prompts, _greedy(plain, prompts)


def _dspark(tiny: TinyV41, plain: LLM, length: str, k: int = 3, **options) -> LLM:
    return _llm(
        tiny,
        loaded=plain.engine.core.loaded,
        speculative_method="dspark",
        num_speculative_tokens=k,
        speculative_length=length,
        **options,
    )


@pytest.mark.parametrize(
    ("length", "options"),
    [
        ("fixed", {}),
        ("fixed", {"prefill_chunk_size": 7}),
        ("fixed", {"num_blocks": 20, "enable_prefix_caching": False, "max_num_batched_tokens": 32}),
        ("dynamic", {}),
    ],
    ids=["fixed", "fixed-chunked", "fixed-preempted", "dynamic"],
)
def test_greedy_is_identical_batched_and_chunked(tiny, plain, reference, length, options):
    prompts, expected = reference
    llm = _dspark(tiny, plain, length, **options)
    assert isinstance(llm.engine.core.spec.proposer, DSparkProposer)
    if length == "dynamic":  # a curve where drafts pay, so the policy drafts (the profile is noise)
        llm.engine.core.spec.set_cost_model(StepCostModel(CostCurve([1, 64], [0.01, 0.01])))
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts[1:2]) == expected[1:2]
    stats = llm.engine.core.spec_stats()
    assert stats.num_draft_tokens > 0
    if "num_blocks" in options:
        assert llm.engine.core.num_preemptions > 0
    assert _blocks_in_use(llm) == 0


def test_accepted_drafts_and_rollback_keep_greedy_output(tiny, plain, reference):
    """DSpark's drafts with a prefix of 0..k of them replaced by the right tokens: every step
    accepts that many and rolls the rest back (V4.1's rows past them are rewritten), and DSpark
    keeps drafting from the accepted positions' features."""
    prompts, expected = reference
    llm = _dspark(tiny, plain, "fixed")
    proposer = llm.engine.core.spec.proposer
    original = proposer.propose
    right = itertools.cycle([0, 3, 1, 2])

    def propose(plan, requests):
        original(plan, requests)
        for request in requests:
            seq = request.seq
            continuation = expected[prompts.index(seq.token_ids[: seq.num_prompt_tokens])]
            done = seq.num_tokens - seq.num_prompt_tokens
            count = min(next(right), len(request.token_ids))
            request.token_ids[:count] = continuation[done : done + count]

    proposer.propose = propose
    assert _greedy(llm, prompts) == expected
    stats = llm.engine.core.spec_stats()
    assert stats.num_accepted_tokens > len(prompts)
    # Every decode step drafts (DSpark always has its features) except where max_tokens leaves none.
    assert stats.chosen_k[0] <= len(prompts)
    assert _blocks_in_use(llm) == 0


def test_confidence_policy_verifies_what_the_cost_curve_pays_for(tiny, plain, reference):
    """Greedy with `speculative_length="confidence"` on DSpark's own confidences: output
    unchanged, and every step's verified lengths reach the best expected tokens per second an
    exhaustive search finds on a synthetic cost curve, so no draft is verified that the curve
    does not pay for."""
    prompts, expected = reference
    llm = _dspark(tiny, plain, "confidence", max_num_seqs=4)
    spec = llm.engine.core.spec
    assert spec.stats.cost_model["verify"]["counts"][:3] == [1, 2, 4]  # profiled at startup
    # 10 ms, then 1.5 ms per token: a draft pays when its P beats the goodput x 1.5 ms.
    spec.set_cost_model(StepCostModel(CostCurve([1, 16], [0.010, 0.0325])))
    allocate = spec.confidence.allocate
    choices = []

    def checked(confidences, *args):
        choice = allocate(confidences, *args)
        best = brute_force(spec.confidence, confidences, *args)[1]
        choices.append((choice, [list(row) for row in confidences], best))  # the requests cut theirs
        return choice

    spec.confidence.allocate = checked
    assert _greedy(llm, prompts) == expected
    assert choices
    offered = verified = 0
    for choice, confidences, best in choices:
        assert choice.goodput == pytest.approx(best, rel=1e-9)
        assert all(0.0 <= c <= 1.0 for row in confidences for c in row)
        offered += sum(len(row) for row in confidences)
        verified += sum(choice.lengths)
    assert 0 < verified < offered  # the confidences, not the bound, set the lengths
    assert _blocks_in_use(llm) == 0


def _target_logits(model, tokens: list[int]) -> torch.Tensor:
    """The target's logits after `tokens` [V] (standalone model, fresh cache)."""
    cache = ContiguousV41Cache(model.arch)
    return _standalone_logits(model, cache, cache.add_sequence(), tokens)[-1]


def _top_k_probs(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the top-k logits, zero elsewhere [V] (temperature 1)."""
    top = logits.double().topk(TOP_K)
    probs = torch.zeros_like(logits, dtype=torch.float64)
    probs[top.indices] = torch.softmax(top.values, dim=-1)
    return probs


@pytest.mark.parametrize("length", ["fixed", "confidence"])
def test_sampled_output_follows_the_target(tiny, plain, monkeypatch, length):
    """Seeded sampled requests (top-k 2) of 3 tokens: the first from the prompt, the next ones
    from verification steps over DSpark's sampled drafts; their joint distribution against the
    target's, computed from the standalone model. The random tiny drafter's top 2 never meet the
    target's, so its draft logits get the target's added: q then overlaps p without being p,
    and drafts are accepted and rejected (the verifier is lossless for any q). Under
    `confidence`, sampled drafting stops at the policy's floor (on the startup profile)."""
    prompt = _prompts(tiny, [11], seed=3)[0]
    model = plain.engine.core.loaded.model
    target_logits = functools.cache(lambda tokens: _target_logits(model, list(tokens)))
    expected: dict[tuple[int, ...], float] = {}
    first = _top_k_probs(target_logits(tuple(prompt)))
    for a in first.nonzero().flatten().tolist():
        second = _top_k_probs(target_logits((*prompt, a)))
        for b in second.nonzero().flatten().tolist():
            third = _top_k_probs(target_logits((*prompt, a, b)))
            for c in third.nonzero().flatten().tolist():
                expected[(a, b, c)] = float(first[a] * second[b] * third[c])

    def overlapping(logits, requests, confidences=None):
        context = [tuple(r.seq.token_ids + r.token_ids) for r in requests]
        mixed = logits + torch.stack([target_logits(c).float() for c in context])
        draw_drafts(mixed, requests, confidences)

    monkeypatch.setattr(dspark, "draw_drafts", overlapping)
    llm = _dspark(tiny, plain, length, max_num_seqs=64)
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(SAMPLED_TRIALS)
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLED_TRIALS, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for output in outputs:
        cell = tuple(output.outputs[0].token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    assert set(counts) <= set(expected)
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > 1e-3, f"output distribution differs from the target (p = {pvalue:.2e})"
    stats = llm.engine.core.spec_stats()
    if length == "fixed":  # the confidence policy's floor depends on the measured profile
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _blocks_in_use(llm) == 0


def test_dspark_is_refused_without_dspark_layers(tmp_path):
    """Before any weight loads (the directories hold a config.json and no shard): a model family
    without DSpark, and a V4.1 checkpoint without DSpark layers."""
    v3 = tmp_path / "v3"
    v3.mkdir()
    (v3 / "config.json").write_text(json.dumps(deepseek_config(96)))
    with pytest.raises(ConfigError, match=r"speculative_method.*'dspark'.*'deepseek_v3' has none"):
        LLM(model=str(v3), speculative_method="dspark", num_threads=1)
    config = tiny_config(num_nextn_predict_layers=0, compress_ratios=[0, 2, 2, 1, 1, 1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"speculative_method.*num_nextn_predict_layers=0"):
        LLM(model=str(tmp_path), speculative_method="dspark", num_threads=1)
    with pytest.raises(ConfigError, match=r"speculative_method.*'ngram'"):
        LLM(model=str(tmp_path), speculative_method="ngram", num_threads=1)
