"""SmolLM2 (the embedded default model) over two tensor-parallel ranks (gloo on loopback, one
thread each) against the single-process engine: its 3 KV heads split 2 + 1, the MLP and the
vocabulary in halves. Greedy outputs are the same, batched and chunked; logits within 1e-4."""

from __future__ import annotations

import os

import pytest

from deepinfer import LLM, SamplingParams
from tests.parallel.helpers import children
from tests.server.server_process import pid_alive, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea, then explain every line of it in detail, and "
    "say which words you chose for their sound.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2():
    # 16-token prefill chunks and a 32-token step budget: the long prompt is chunked, and
    # chunks share steps with decode rows.
    llm = LLM(
        tensor_parallel_size=2,
        num_threads=1,
        kv_cache_memory=64 << 20,
        prefill_chunk_size=16,
        max_num_batched_tokens=32,
    )
    yield llm
    llm.close()  # idempotent


def test_shards_split_heads_unevenly(tp2):
    model = tp2.engine.core.loaded.model
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (6, 2)  # rank 0 of 9 query / 3 KV heads
    assert model.layers[0].mlp.intermediate == 768
    assert model.embed_tokens.weight.shape[0] == 49152 // 2


def test_logits_match_one_process(tp2, dense_llm):
    tokenizer = dense_llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours, theirs = tp2.engine.core.score(ids), dense_llm.engine.core.score(ids)
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_batched_and_chunked_matches_one_process(tp2, dense_llm):
    expected = [o.outputs[0].token_ids for o in dense_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    batched = [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, PARAMS, use_tqdm=False)]
    alone = [tp2.generate([p], PARAMS, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[2:]]
    assert batched == expected
    assert alone == expected[2:]


def test_close_stops_the_other_rank(tp2):
    """Last in the module: closes the shared engine."""
    [rank1] = tp2.engine.core.parallel.rank_pids
    assert rank1 in children(os.getpid()) and pid_alive(rank1)
    tp2.close()
    assert wait_until(lambda: not pid_alive(rank1), 15)
