"""MTP speculation on a tiny random DeepSeek-V3 checkpoint.

Greedy outputs equal plain decoding under batching, chunked prefill, prefix caching and
preemption; and the first draft of every step is exactly the MTP module's prediction computed from
scratch by the reference (HF decoder layer + the report's formula), which checks that the pending
rows, the paged MTP cache and fork inheritance keep the module's inputs right across steps.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.deepseek.test_mtp import reference_draft_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def base(v3_mtp_ckpt) -> LLM:
    return LLM(model=str(v3_mtp_ckpt.path), num_blocks=64, num_threads=1)


@pytest.fixture(scope="module")
def prompts(v3_mtp_ckpt) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = v3_mtp_ckpt.config["vocab_size"]
    shared = torch.randint(3, vocab, (40,), generator=generator).tolist()
    return [shared + torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 30)] + [
        torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (70, 12)
    ]


@pytest.fixture(scope="module")
def reference(base, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "options",
    [
        {"speculative_length": "fixed", "num_blocks": 64},
        {"speculative_length": "dynamic", "num_blocks": 64},
        {"speculative_length": "confidence", "num_blocks": 64},
        # 9 blocks of 16 hold any one sequence (<= 110 tokens + drafts) but not all four.
        {"speculative_length": "fixed", "num_blocks": 9, "prefill_chunk_size": 32},
    ],
    ids=["fixed", "dynamic", "confidence", "preemption"],
)
def test_mtp_greedy_is_identical(base, prompts, reference, options):
    llm = LLM(
        loaded=base.engine.core.loaded,
        num_threads=1,
        speculative_method="mtp",
        num_speculative_tokens=3,
        **options,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.core.kv.num_used_blocks == 0
    if options["num_blocks"] == 9:
        assert llm.engine.core.num_preemptions > 0
    assert llm.engine.core.spec_stats().num_decode_steps > 0


def test_first_draft_is_the_mtp_prediction(base, prompts, v3_mtp_ckpt):
    llm = LLM(
        loaded=base.engine.core.loaded,
        num_threads=1,
        num_blocks=64,
        prefill_chunk_size=16,
        speculative_method="mtp",
        num_speculative_tokens=2,
        speculative_length="fixed",
    )
    proposer = llm.engine.core.spec.proposer
    drafted: list[tuple[list[int], int]] = []
    propose = proposer.propose

    def recording(plan, requests):
        propose(plan, requests)
        drafted.extend((list(r.seq.token_ids), r.token_ids[0]) for r in requests if r.token_ids)

    proposer.propose = recording
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    llm.generate(prompts[:2], params, use_tqdm=False)
    assert len(drafted) >= 4 * 4  # four sequences (two forked), several steps each
    for token_ids, first_draft in drafted:
        expected = reference_draft_logits(v3_mtp_ckpt, token_ids)[-1].argmax().item()
        assert first_draft == expected
