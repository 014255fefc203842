"""DeepSeek-V4.1 through the real engine (`deepinfer.LLM`) on its paged hybrid cache.

The tiny checkpoint (tiny_v41.py, with a small BPE tokenizer for its vocabulary) has an 8-token
window and six layers: sliding, C2 (KV and index-K source), C2 (sharing them), C1 (KV and
index-K source), C1 (sharing its KV and top-k), C1 (own indexer, shared keys); Engram on layers
1 and 4 (n-grams of up to 3 tokens). Blocks of 4 tokens. Greedy output is compared with the
standalone model over ContiguousV41Cache (test_model.py checks that one: whole prompt = token by
token = chunks = batched).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError
from deepinfer.model.deepseek_v4.cache import CacheKind, StepLayout
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.runner.inputs import ForwardWork, RowSpan
from deepinfer.sequence import EngineRequest, Sequence
from tests.deepseek.tiny_checkpoint import build_tokenizer
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.tiny_v41 import TinyV41, build_v41, tiny_config

BLOCK = 4
WINDOW = 8
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> TinyV41:
    path = tmp_path_factory.mktemp("v41_engine")
    vocab = build_tokenizer(path)  # the engine serves text: the tokenizer decides the vocabulary
    return build_v41(path, tiny_config(vocab_size=vocab, sliding_window=WINDOW), seed=4)


def _llm(tiny: TinyV41, **options) -> LLM:
    options.setdefault("num_blocks", 256)
    return LLM(model=str(tiny.path), block_size=BLOCK, num_threads=1, **options)


def _prompts(tiny: TinyV41, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = tiny.config["text_config"]["vocab_size"]
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _standalone_logits(
    model: DeepseekV41ForCausalLM, cache: ContiguousV41Cache, seq: int, chunk: list[int]
) -> torch.Tensor:
    start = cache.length(seq)
    layout = StepLayout((start,), (len(chunk),))
    positions = torch.arange(start, start + len(chunk))
    with torch.no_grad():
        hidden = model.forward_cached(torch.tensor(chunk), positions, layout, cache.step([seq], layout))
        return model.compute_logits(hidden)


def _standalone_greedy(model: DeepseekV41ForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    out: list[int] = []
    chunk = prompt
    while len(out) < max_tokens:
        out.append(int(_standalone_logits(model, cache, seq, chunk)[-1].argmax()))
        chunk = out[-1:]
    return out


def _blocks_in_use(llm: LLM) -> int:
    return llm.engine.core.kv.num_used_blocks


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Prompts over several windows (and C2 blocks left open at the prompt's end), and their
    standalone greedy continuations."""
    llm = _llm(checkpoint)
    prompts = _prompts(checkpoint, [5, 23, 41, 64, 9])
    model = llm.engine.core.loaded.model
    return prompts, [_standalone_greedy(model, p, MAX_TOKENS) for p in prompts]


def test_groups_follow_the_declarations(checkpoint):
    llm = _llm(checkpoint, num_blocks=32)
    core = llm.engine.core
    shapes = [
        (g.group.kind, g.group.window, g.group.tokens_per_entry, len(g.group.tensors))
        for g in core.layout.groups
    ]
    # raw KV of the 6 layers; the C2 state of layer 1 (the one C2 KV source); C2 entries + index
    # keys of layer 1; C1 entries + index keys of layer 3; the token ids Engram reads back 2 of.
    assert shapes == [
        ("sliding", WINDOW, 1, 6),
        ("sliding", 2, 1, 1),
        ("compressed", None, 2, 2),
        ("full", None, 1, 2),
        ("sliding", 3, 1, 1),
    ]
    names = [t.name for g in core.layout.groups for t in g.group.tensors]
    assert names[6:] == [
        "layers.1.compressor_state",
        "layers.1.compressed_kv",
        "layers.1.indexer_keys",
        "layers.3.compressed_kv",
        "layers.3.indexer_keys",
        "layers.1.token_ids",
    ]
    assert core.kv.hit_granularity == BLOCK  # a C2 block (2 entries) covers 4 tokens too
    assert core.runner.backend.name == "model"
    assert isinstance(core.loaded.model, DeepseekV41ForCausalLM)


def test_bytes_per_token_per_group_equal_the_config_formula(checkpoint):
    """Growing with the context: per KV source head_dim / ratio and per index-K source
    index_head_dim / ratio (layers sharing them count nothing); a window of rows otherwise."""
    text = checkpoint.config["text_config"]
    head_dim, index_dim, ratios = text["head_dim"], text["index_head_dim"], text["compress_ratios"]
    c2 = sum(head_dim for s in text["kv_source_layer_ids"] if ratios[s] == 2) / 2
    c2 += sum(index_dim for s in text["index_k_source_layer_ids"] if ratios[s] == 2) / 2
    c1 = sum(head_dim for s in text["kv_source_layer_ids"] if ratios[s] == 1)
    c1 += sum(index_dim for s in text["index_k_source_layer_ids"] if ratios[s] == 1)
    llm = _llm(checkpoint, num_blocks=32)
    groups = llm.engine.core.layout.groups
    per_group = [g.group.entry_bytes / g.group.tokens_per_entry for g in groups]
    assert per_group[2:4] == [c2 * 4, c1 * 4]
    assert llm.engine.core.kv_bytes_per_token == (c1 + c2) * 4
    backbone = text["num_hidden_layers"]
    c2_sources = [s for s in text["kv_source_layer_ids"] if ratios[s] == 2]
    assert per_group[0] == backbone * head_dim * 4  # a window of these, whatever the length
    assert per_group[1] == len(c2_sources) * 2 * head_dim * 4  # [logits | latent] per token
    assert per_group[4] == 8  # one int64 token id
    assert groups[4].group.tensors[0].dtype == "int64"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_standalone(checkpoint, reference, async_scheduling):
    prompts, expected = reference
    llm = _llm(checkpoint, async_scheduling=async_scheduling)
    assert _greedy(llm, prompts) == expected
    assert _blocks_in_use(llm) == 0


def test_forks_share_blocks_and_decode_like_one_sequence(checkpoint, reference):
    """n = 3 siblings fork when the prompt is done (copy-on-write of the partial last blocks of
    every group, the C2 state and token ids included) and each decodes the standalone tokens."""
    prompts, expected = reference
    llm = _llm(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:3]], params, use_tqdm=False)
    for out, want in zip(outputs, expected[1:3]):
        assert [list(c.token_ids) for c in out.outputs] == [want] * 3
    assert _blocks_in_use(llm) == 0


@pytest.mark.parametrize("chunk", [1, 5])
def test_logits_through_the_paged_cache_match_the_contiguous_cache(checkpoint, chunk):
    """A 28-token prompt (3.5 windows, 14 C2 entries) fed `chunk` tokens per forward through the
    engine's runner and KV manager (sliding blocks released as the window moves): fp32 logits
    within 1e-5 of the whole prompt over the contiguous cache."""
    llm = _llm(checkpoint, enable_prefix_caching=False)
    core = llm.engine.core
    (ids,) = _prompts(checkpoint, [28], seed=13)
    seq = Sequence(-1, EngineRequest("paged", ids, SamplingParams()), 0, list(ids), len(ids), b"")
    got = []
    for start in range(0, len(ids), chunk):
        tokens = ids[start : start + chunk]
        core.kv.allocate(seq, len(tokens))
        span = RowSpan(core.runner.view.tables(seq), start, tokens)
        _, _, logits = core.runner.run(ForwardWork([span], core.kv.take_copies(), list(range(len(tokens)))))
        seq.num_computed_tokens += len(tokens)
        got.append(logits)
    sliding = [i for i, g in enumerate(core.layout.groups) if g.group.kind == "sliding"]
    released = [sum(b == -1 for b in seq.block_tables[i]) for i in sliding]
    core.kv.free(seq)
    model = core.loaded.model
    cache = ContiguousV41Cache(model.arch)
    expected = _standalone_logits(model, cache, cache.add_sequence(), ids)
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=0)
    assert min(released) > 0  # every sliding group gave blocks back while the prompt ran


def test_one_at_a_time_batched_and_chunked_agree(checkpoint, reference):
    prompts, expected = reference
    alone = _llm(checkpoint, enable_prefix_caching=False)
    assert [_greedy(alone, [p])[0] for p in prompts] == expected
    for chunk in (7, 32):
        llm = _llm(
            checkpoint, enable_prefix_caching=False, max_num_batched_tokens=chunk, prefill_chunk_size=chunk
        )
        assert _greedy(llm, prompts) == expected, f"chunks of {chunk}"
        assert _blocks_in_use(llm) == 0


def test_preempting_budget_recomputes_the_same_tokens(checkpoint, reference):
    prompts, expected = reference
    llm = _llm(checkpoint, num_blocks=40, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert _greedy(llm, prompts) == expected
    assert llm.engine.core.num_preemptions > 0
    assert _blocks_in_use(llm) == 0


def test_prefix_hits_of_several_lengths_equal_no_caching(checkpoint):
    """Variants share 4, 12, 28 and 48 tokens of a 56-token prompt: hits inside the first window
    and after several, with C1 and C2 entries and Engram's token ids before them."""
    (base,) = _prompts(checkpoint, [56], seed=5)
    tails = _prompts(checkpoint, [5, 9, 3, 6], seed=6)
    shared = [4, 12, 28, 48]
    variants = [base[:n] + tail for n, tail in zip(shared, tails)]
    off = _llm(checkpoint, enable_prefix_caching=False)
    expected = _greedy(off, [base, *variants])
    on = _llm(checkpoint)
    assert _greedy(on, [base]) == expected[:1]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    hits = []
    for variant, want in zip(variants, expected[1:]):
        (out,) = on.generate([{"prompt_token_ids": variant}], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == want
        hits.append(out.num_cached_tokens)
    assert hits == shared
    assert _blocks_in_use(on) == 0


def test_long_sequence_holds_a_window_of_sliding_pages(checkpoint):
    """15 windows of context: each sliding group holds at most the blocks its window touches
    at every decode step, while the C1 and C2 groups hold every entry so far."""
    llm = _llm(checkpoint, num_blocks=512, enable_prefix_caching=False, max_num_batched_tokens=32)
    core = llm.engine.core
    (prompt,) = _prompts(checkpoint, [15 * WINDOW], seed=8)
    llm.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    sliding = [(g.pool, g.window) for g in core.kv.groups if g.layout.group.kind == "sliding"]
    growing = [(g.pool, g.block_tokens) for g in core.kv.groups if g.layout.group.kind != "sliding"]
    decode_steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        seq = next(iter(core.scheduler.running), None)
        if seq is None or seq.num_computed_tokens <= len(prompt):
            continue
        decode_steps += 1
        for pool, window in sliding:
            # the positions a step reads back span at most this many blocks
            assert pool.num_blocks - pool.num_free <= -(-(window - 1) // BLOCK) + 1, window
        for pool, block_tokens in growing:
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
    ("options", "option"),
    [
        ({"speculative_method": "ngram", "num_speculative_tokens": 2}, "speculative_method"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_unsupported_features_are_refused_before_loading(checkpoint, monkeypatch, options, option):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the option was refused")

    monkeypatch.setattr(DeepseekV41ForCausalLM, "from_checkpoint", no_loading)
    with pytest.raises(ConfigError) as refused:
        _llm(checkpoint, **options)
    assert refused.value.name == option


def test_token_ids_are_kept_for_engram(checkpoint):
    """The Engram context rows hold the token ids themselves (int64), under the first Engram layer."""
    llm = _llm(checkpoint, enable_prefix_caching=False)
    core = llm.engine.core
    (ids,) = _prompts(checkpoint, [6], seed=3)
    seq = Sequence(-1, EngineRequest("ids", ids, SamplingParams()), 0, list(ids), len(ids), b"")
    core.kv.allocate(seq, len(ids))
    span = RowSpan(core.runner.view.tables(seq), 0, ids)
    core.runner.run(ForwardWork([span], core.kv.take_copies(), []))
    group = next(
        i for i, g in enumerate(core.layout.groups) if g.group.tensors[0].name.endswith(CacheKind.TOKEN_IDS)
    )
    tensor = core.runner.view.tensors[sum(len(g.group.tensors) for g in core.layout.groups[:group])]
    table = seq.block_tables[group]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(ids))]
    assert tensor[slots, 0].tolist() == ids
    core.kv.free(seq)
