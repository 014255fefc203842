"""Speculative decoding in the engine, on the real default model (SmolLM2-135M).

Greedy outputs must be token-identical to plain decoding for every proposer, batched or alone,
under preemption, chunked prefill and prefix caching; the model drafting for itself must have every
draft accepted; n-gram drafts on a prompt that asks to repeat a passage must be mostly accepted.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.speculative.cost_model import CostCurve, StepCostModel
from tests.speculative.test_confidence_policy import brute_force

CODE = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
"""


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


REPEAT = chat(f"Repeat this code exactly, without comments:\n{CODE}")
PROMPTS = [REPEAT, chat("Write two sentences about the ocean."), chat("Name three colors.")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_llm(default_llm) -> LLM:
    """Every engine here runs one torch thread: on a shared 2-core machine, two threads that wait
    on each other's core make each step several times slower."""
    return LLM(loaded=default_llm.engine.core.loaded, kv_cache_memory=64 << 20, num_threads=1)


@pytest.fixture(scope="module")
def reference(plain_llm) -> list[list[int]]:
    return tokens(plain_llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def ngram_llm(default_llm) -> LLM:
    return LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        kv_cache_memory=64 << 20,
        speculative_method="ngram",
        num_speculative_tokens=5,
        speculative_length="fixed",
    )


@pytest.fixture(scope="module")
def draft_llm(default_llm) -> LLM:
    return LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        kv_cache_memory=64 << 20,
        speculative_method="draft",
        num_speculative_tokens=3,
        speculative_length="fixed",
    )


def test_ngram_greedy_is_identical_batched_and_alone(ngram_llm, reference):
    assert tokens(ngram_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert tokens(ngram_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == reference[:1]
    assert ngram_llm.engine.core.spec_stats().num_spec_steps > 0


def test_dynamic_length_policy_in_the_engine(default_llm, reference):
    llm = LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        kv_cache_memory=64 << 20,
        max_num_seqs=2,
        speculative_method="ngram",
        num_speculative_tokens=5,
        speculative_length="dynamic",
    )
    profile = llm.engine.core.spec_stats().cost_model["verify"]
    assert profile["counts"][:4] == [1, 2, 4, 8] and all(s > 0 for s in profile["seconds"])
    assert profile["seconds"] == sorted(profile["seconds"])
    # The profile of a shared machine is noise-dependent; a fixed GPU-like curve (verifying a few
    # tokens costs what one does) makes the policy's choices, and so this test, deterministic.
    llm.engine.core.spec.policy.cost = StepCostModel(CostCurve([1, 16, 64], [0.01, 0.01, 0.04]))
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    stats = llm.engine.core.spec_stats()
    assert sum(stats.chosen_k[1:]) > 0 and stats.num_accepted_tokens > 0


def test_confidence_policy_with_the_draft_model(default_llm, reference):
    """The model drafting for itself with its own argmax probabilities as confidences: greedy
    output unchanged, and every step verifies exactly the lengths that maximize expected tokens
    per second on the (synthetic) cost curve, checked against an exhaustive search."""
    llm = LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        kv_cache_memory=64 << 20,
        max_num_seqs=2,  # a short startup profile: steps of at most 2 x (1 + 3) tokens
        speculative_method="draft",
        num_speculative_tokens=3,
        speculative_length="confidence",
    )
    spec = llm.engine.core.spec
    assert spec.stats.cost_model["verify"]["counts"][:3] == [1, 2, 4]  # profiled at startup
    # 10 ms and 2 ms per token: a draft pays when its P exceeds the goodput x 2 ms (about 0.35).
    spec.set_cost_model(StepCostModel(CostCurve([1, 16], [0.010, 0.040])))
    choices = []
    allocate = spec.confidence.allocate

    def checked(*args):
        """The policy's choice, and the best goodput an exhaustive search finds for the same
        step (now: measured steps keep calibrating the cost model's per-step overhead)."""
        choice = allocate(*args)
        choices.append((choice, brute_force(spec.confidence, *args)[1]))
        return choice

    spec.confidence.allocate = checked
    short = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:2], short, use_tqdm=False)) == [r[:10] for r in reference[:2]]
    stats = llm.engine.core.spec_stats()
    verified = [k for choice, _ in choices for k in choice.lengths]
    assert [verified.count(k) for k in (1, 2, 3)] == stats.chosen_k[1:]
    assert len(set(verified)) > 1  # the confidences, not the bound, set the lengths
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # drafting for itself
    for choice, best in choices:
        assert choice.goodput == pytest.approx(best, rel=1e-9)


@pytest.fixture(scope="module")
def ngram_fixed_llm(default_llm) -> LLM:
    return LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        kv_cache_memory=64 << 20,
        speculative_method="ngram",
        speculative_length="fixed",
    )


def test_ngram_drafts_of_a_repeated_passage_are_mostly_accepted(ngram_fixed_llm):
    llm = ngram_fixed_llm
    # The model copies the first 26 tokens of the code exactly (then drifts from it).
    params = SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)
    out = llm.generate(REPEAT, params, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("def moving_average(values, window):\n    if window <= 0:\n        raise")
    stats = llm.engine.core.spec_stats()
    print(f"n-gram on a repeated passage: {stats.to_dict()}")
    assert stats.acceptance_rate > 0.6
    assert stats.tokens_per_decode_step > 2.5


def test_the_model_drafting_for_itself_is_always_accepted(draft_llm, reference):
    assert tokens(draft_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    stats = draft_llm.engine.core.spec_stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.acceptance_per_position == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_is_identical_under_preemption_chunking_and_prefix_caching(default_llm, reference, method):
    # The prompts need 8 + 2 + 2 blocks of 16 tokens at the end (plus draft slots); 9 forces preemption.
    llm = LLM(
        loaded=default_llm.engine.core.loaded,
        num_threads=1,
        num_blocks=9,
        prefill_chunk_size=32,
        speculative_method=method,
        num_speculative_tokens=4,
        speculative_length="fixed",
    )
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.core.num_preemptions > 0
    assert llm.engine.core.kv.num_used_blocks == 0
    assert sum(llm.engine.core.spec_stats().chosen_k[1:]) > 0


def test_sampling_through_the_verifier(ngram_llm, draft_llm, reference):
    """top_k=1 makes the target deterministic: sampled speculation must give the greedy tokens.
    Seeded requests (n=2) reproduce; logprobs come one per token."""
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True)
    assert tokens(ngram_llm.generate(PROMPTS[:2], top1, use_tqdm=False)) == reference[:2]
    assert tokens(draft_llm.generate(PROMPTS[:2], top1, use_tqdm=False)) == reference[:2]
    seeded = SamplingParams(temperature=0.7, seed=1234, n=2, max_tokens=12, logprobs=1, ignore_eos=True)
    first = draft_llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0]
    again = draft_llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    for output in first.outputs:
        assert len(output.logprobs) == len(output.token_ids) == 12


def test_stops_inside_an_accepted_run(plain_llm, ngram_fixed_llm, reference):
    """A stop string or stop token met in the middle of an accepted run (five drafts accepted per
    step while the model copies the code) ends the output exactly where plain decoding ends it."""
    stop_string = SamplingParams(temperature=0.0, max_tokens=24, stop=["<= 0"])
    plain = plain_llm.generate(REPEAT, stop_string, use_tqdm=False)[0].outputs[0]
    spec = ngram_fixed_llm.generate(REPEAT, stop_string, use_tqdm=False)[0].outputs[0]
    assert plain.text.endswith("if window ") and plain.stop_reason == "<= 0"
    assert (spec.text, spec.token_ids, spec.stop_reason) == (plain.text, plain.token_ids, plain.stop_reason)
    stop = reference[0][9]
    stop_token = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop])
    spec = ngram_fixed_llm.generate(REPEAT, stop_token, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == reference[0][: reference[0].index(stop) + 1] and spec.stop_reason == stop


def test_bad_options_are_named(default_llm, v3_ckpt_path):
    loaded = default_llm.engine.core.loaded
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(loaded=loaded, num_blocks=8, num_threads=1, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_method='mtp'"):
        LLM(loaded=loaded, num_blocks=8, num_threads=1, speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(
            loaded=loaded,
            num_blocks=8,
            num_threads=1,
            speculative_method="draft",
            speculative_model=str(v3_ckpt_path),
        )
