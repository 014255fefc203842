"""DeepSeek-V4 through the real engine (`deepinfer.LLM`) on its paged hybrid cache.

The checkpoint has a 16-token window, CSA at 4 and HCA at 8, so the model declares two sliding
groups (window 16: the raw KV; window 8: the compressor and indexer state) and two compressed
groups (rate 4: CSA entries and indexer keys; rate 8: HCA entries). Blocks of 4 tokens: prefix
hits fall on multiples of lcm(4, 4, 4, 8) = 8 tokens, i.e. inside the 16-token window. Greedy
output is compared with the standalone model (forward_cached over ContiguousV4Cache, itself
checked against transformers in test_parity_hf.py) and with transformers' generate.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.deepseek_v4.cache import CacheKind
from deepinfer.runner.inputs import ForwardWork, RowSpan
from deepinfer.sequence import EngineRequest, Sequence
from tests.deepseek_v4.conftest import WINDOW, CachedRun
from tests.deepseek_v4.test_mtp import reference_draft_logits
from tests.deepseek_v4.tiny_v4 import TinyV4

BLOCK = 4


def _llm(tiny: TinyV4, **options) -> LLM:
    options.setdefault("num_blocks", 256)
    return LLM(model=str(tiny.path), block_size=BLOCK, num_threads=1, **options)


def _prompts(tiny: TinyV4, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = tiny.config["vocab_size"]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _standalone_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    run = CachedRun(model)
    seq = run.new_sequence()
    (logits,) = run.logits({seq: prompt})
    out = [int(logits[-1].argmax())]
    while len(out) < max_tokens:
        (logits,) = run.logits({seq: out[-1:]})
        out.append(int(logits[-1].argmax()))
    return out


def _blocks_in_use(llm: LLM) -> int:
    return llm.engine.core.kv.num_used_blocks


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Prompts over several windows and compression windows, and their standalone greedy output."""
    llm = _llm(checkpoint)
    prompts = _prompts(checkpoint, [5, 23, 41, 70, 9, 100])
    model = llm.engine.core.loaded.model
    with torch.no_grad():
        expected = [_standalone_greedy(model, p, 16) for p in prompts]
    return prompts, expected


def test_groups_follow_the_declarations(checkpoint):
    llm = _llm(checkpoint, num_blocks=32)
    layout = llm.engine.core.layout
    shapes = [
        (g.group.kind, g.group.window, g.group.tokens_per_entry, len(g.group.tensors)) for g in layout.groups
    ]
    # 5 layers (sliding, CSA, HCA, CSA, HCA): raw KV on every layer; compressor state on the 4
    # compressed layers + indexer state on the 2 CSA ones; CSA entries + indexer keys; HCA entries.
    assert shapes == [
        ("sliding", 16, 1, 5),
        ("sliding", 8, 1, 6),
        ("compressed", None, 4, 4),
        ("compressed", None, 8, 2),
    ]
    assert llm.engine.core.kv.hit_granularity == 8
    assert llm.engine.core.runner.backend.name == "model"


def test_bytes_per_token_per_group_equal_the_config_formula(checkpoint):
    """Only the compressed groups grow with the context: CSA 2 layers x (head_dim + index_head_dim)
    / 4, HCA 2 layers x head_dim / 8, in fp32 values."""
    cfg = checkpoint.config
    head_dim, index_dim = cfg["head_dim"], cfg["index_head_dim"]
    csa = 2 * (head_dim + index_dim) * 4 / 4
    hca = 2 * head_dim * 4 / 8
    llm = _llm(checkpoint, num_blocks=32)
    groups = llm.engine.core.layout.groups
    per_group = [g.group.entry_bytes / g.group.tokens_per_entry for g in groups]
    assert per_group[2:] == [csa, hca]
    assert llm.engine.core.kv_bytes_per_token == csa + hca
    # Sliding groups: a window of rows, whatever the length.
    assert per_group[0] == 5 * head_dim * 4
    kinds = {CacheKind.COMPRESSOR_STATE: 0, CacheKind.INDEXER_STATE: 0}
    for tensor in groups[1].group.tensors:
        kinds[CacheKind(tensor.name.rsplit(".", 1)[1])] += tensor.slot_bytes
    assert kinds == {
        CacheKind.COMPRESSOR_STATE: 2 * 4 * head_dim * 4 + 2 * 2 * head_dim * 4,
        CacheKind.INDEXER_STATE: 2 * 4 * index_dim * 4,
    }


def test_greedy_matches_standalone_and_hf(checkpoint, reference):
    prompts, expected = reference
    llm = _llm(checkpoint)
    assert _greedy(llm, prompts) == expected
    prompt = prompts[3]
    with torch.no_grad():
        hf = checkpoint.hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )
    assert hf[0, len(prompt) :].tolist() == expected[3]
    assert _blocks_in_use(llm) == 0


@pytest.mark.parametrize("chunk", [1, 5])
def test_logits_through_the_paged_cache_match_hf(checkpoint, chunk):
    """A 56-token prompt (3.5 windows, 7 HCA entries) fed `chunk` tokens per forward through the
    engine's runner and KV manager (sliding blocks released as the window moves): fp32 logits
    within 1e-4 of transformers' whole-prompt forward."""
    llm = _llm(checkpoint, enable_prefix_caching=False)
    core = llm.engine.core
    (ids,) = _prompts(checkpoint, [56], seed=13)
    seq = Sequence(-1, EngineRequest("paged", ids, SamplingParams()), 0, list(ids), len(ids), b"")
    got = []
    for start in range(0, len(ids), chunk):
        tokens = ids[start : start + chunk]
        core.kv.allocate(seq, len(tokens))
        span = RowSpan(core.runner.view.tables(seq), start, tokens)
        _, _, logits = core.runner.run(ForwardWork([span], core.kv.take_copies(), list(range(len(tokens)))))
        seq.num_computed_tokens += len(tokens)
        got.append(logits)
    released = [sum(b == -1 for b in table) for table in seq.block_tables[:2]]
    core.kv.free(seq)
    with torch.no_grad():
        expected = checkpoint.hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)
    assert min(released) > 0  # both sliding groups gave blocks back while the prompt ran


def test_forks_share_blocks_and_decode_like_one_sequence(checkpoint, reference):
    prompts, expected = reference
    llm = _llm(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:4]], params, use_tqdm=False)
    for out, want in zip(outputs, expected[2:4]):
        assert [list(c.token_ids) for c in out.outputs] == [want] * 3
    assert _blocks_in_use(llm) == 0


def test_one_at_a_time_batched_and_chunked_agree(checkpoint, reference):
    prompts, expected = reference
    alone_llm = _llm(checkpoint, enable_prefix_caching=False)
    assert [_greedy(alone_llm, [p])[0] for p in prompts] == expected
    for chunk in (7, 32):
        llm = _llm(
            checkpoint, enable_prefix_caching=False, max_num_batched_tokens=chunk, prefill_chunk_size=chunk
        )
        assert _greedy(llm, prompts) == expected, f"chunks of {chunk}"
        assert _blocks_in_use(llm) == 0


def test_preempting_budget_recomputes_the_same_tokens(checkpoint, reference):
    prompts, expected = reference
    llm = _llm(checkpoint, num_blocks=48, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert _greedy(llm, prompts) == expected
    assert llm.engine.core.num_preemptions > 0
    assert _blocks_in_use(llm) == 0


def test_prefix_hits_of_several_lengths_equal_no_caching(checkpoint):
    """Variants share 8, 24, 40 and 64 tokens of a 70-token prompt: hits ending inside the
    16-token window and after several HCA entries."""
    (base,) = _prompts(checkpoint, [70], seed=5)
    tails = _prompts(checkpoint, [5, 9, 3, 6], seed=6)
    shared = [8, 24, 40, 64]
    variants = [base[:n] + tail for n, tail in zip(shared, tails)]
    off = _llm(checkpoint, enable_prefix_caching=False)
    expected = _greedy(off, [base, *variants])
    on = _llm(checkpoint)
    assert _greedy(on, [base]) == expected[:1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    hits = []
    for variant, want in zip(variants, expected[1:]):
        (out,) = on.generate([{"prompt_token_ids": variant}], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == want
        hits.append(out.num_cached_tokens)
    assert hits == shared
    assert _blocks_in_use(on) == 0


def test_long_sequence_holds_a_window_of_sliding_pages(checkpoint):
    """20 windows of context: each sliding group holds at most its window plus one block of
    pages at every decode step, while the compressed groups hold every entry so far."""
    llm = _llm(checkpoint, num_blocks=512, enable_prefix_caching=False, max_num_batched_tokens=64)
    core = llm.engine.core
    (prompt,) = _prompts(checkpoint, [20 * WINDOW - 8], seed=8)
    llm.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    sliding = [(g.pool, g.window) for g in core.kv.groups if g.layout.group.kind == "sliding"]
    compressed = [(g.pool, g.block_tokens) for g in core.kv.groups if g.layout.group.kind == "compressed"]
    decode_steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        seq = next(iter(core.scheduler.running), None)
        if seq is None or seq.num_computed_tokens <= len(prompt):
            continue
        decode_steps += 1
        for pool, window in sliding:
            held = pool.num_blocks - pool.num_free
            assert held * BLOCK <= window + BLOCK, (held, window)
        for pool, block_tokens in compressed:
            # exactly the blocks of the entries so far: the formula's bytes, rounded up to a block
            assert pool.num_blocks - pool.num_free == -(-seq.num_computed_tokens // block_tokens)
    assert decode_steps >= 8
    assert _blocks_in_use(llm) == 0


def test_aborted_requests_leave_no_blocks(checkpoint):
    llm = _llm(checkpoint)
    prompts = _prompts(checkpoint, [30, 45, 12], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ids = [llm.engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        llm.engine.step()
    assert _blocks_in_use(llm) > 0
    for request_id in ids:
        llm.engine.abort_request(request_id)
    assert _blocks_in_use(llm) == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "options",
    [{"num_blocks": 256}, {"num_blocks": 48, "prefill_chunk_size": 32, "enable_prefix_caching": False}],
    ids=["plain", "preemption"],
)
def test_mtp_speculation_keeps_greedy_output(checkpoint, reference, options):
    prompts, expected = reference
    llm = _llm(
        checkpoint, speculative_method="mtp", num_speculative_tokens=3, speculative_length="fixed", **options
    )
    assert [g.group.kind for g in llm.engine.core.layout.groups][-1] == "full"  # the MTP block's raw KV
    assert _greedy(llm, prompts) == expected
    assert llm.engine.core.spec_stats().num_decode_steps > 0
    if options["num_blocks"] == 48:
        assert llm.engine.core.num_preemptions > 0
    assert _blocks_in_use(llm) == 0


def test_first_draft_is_the_mtp_prediction(checkpoint):
    """Every step's first draft equals the MTP module's prediction from scratch (HF pieces and
    DeepSeek's formula, test_mtp.py), through pending rows, chunked prefill and forks."""
    llm = _llm(
        checkpoint,
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
    llm.generate(
        [{"prompt_token_ids": p} for p in _prompts(checkpoint, [37, 20], seed=12)], params, use_tqdm=False
    )
    assert len(drafted) >= 8
    for token_ids, first_draft in drafted:
        assert first_draft == reference_draft_logits(checkpoint, token_ids)[-1].argmax().item()
