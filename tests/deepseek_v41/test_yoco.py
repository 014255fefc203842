"""YoCo's bounded replay (model/deepseek_v4/yoco.py) on the tiny V4.1 (float32; layers 3, 4, 5 past the
boundary, window 8): the kept rows equal every row computed with the same clipped windows, and
the unclipped model where the windows cannot reach the floor; chunks, decoding and rollbacks
never read a skipped row; the option is refused where it cannot hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ConfigError, EngineConfig
from deepinfer.model.base import CausalLM
from deepinfer.model.config import ModelConfig
from deepinfer.model.deepseek_v4.cache import StepLayout
from deepinfer.model.deepseek_v4.v41_model import DeepseekV41ForCausalLM
from deepinfer.model.deepseek_v4.yoco import BoundedReplay, check_keep_tokens, prompt_floors
from deepinfer.model.loader.load import check_model_engine
from deepinfer.runner.inputs import ForwardWork, RowSpan
from deepinfer.sequence import EngineRequest, Sequence
from tests.deepseek.tiny_checkpoint import build_tokenizer
from tests.deepseek_v41.oracle_cache import ContiguousV41Cache
from tests.deepseek_v41.tiny_v41 import build_v41, tiny_config

PROMPT = 40
TOL = 1e-5
CPU = torch.device("cpu")
ENGINE_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> DeepseekV41ForCausalLM:
    path = tmp_path_factory.mktemp("v41_yoco") / "tiny"
    build_v41(path, tiny_config(), seed=0)
    return DeepseekV41ForCausalLM.from_pretrained(path)


def _ids(n: int = PROMPT + 6) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(5))


def _step(
    model: DeepseekV41ForCausalLM,
    cache: ContiguousV41Cache,
    seq: int,
    ids: torch.Tensor,
    n: int,
    keep: int | None,
) -> torch.Tensor:
    """The next n tokens of `ids` (the prompt: its first PROMPT) -> logits [n, vocab]; `keep`:
    bounded replay of the prompt's last `keep` tokens (None: off)."""
    start = cache.length(seq)
    layout = StepLayout((start,), (n,))
    replay = None if keep is None else BoundedReplay.plan(layout, prompt_floors(layout, (PROMPT,), keep), CPU)
    hidden = model.forward_cached(
        ids[start : start + n],
        torch.arange(start, start + n),
        layout,
        cache.step([seq], layout),
        None,
        replay,
    )
    return model.compute_logits(hidden)


def _prefill(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor, chunks: list[int], keep: int | None, backtrack: int = 16
) -> tuple[torch.Tensor, ContiguousV41Cache, int]:
    """A prefill over a cache whose consumer sliding rows start as NaN: a read of a row no step
    wrote (a skipped one) turns the output NaN."""
    cache = ContiguousV41Cache(model.arch, backtrack=backtrack)
    seq = cache.add_sequence()
    _poison(model, cache, seq, len(ids))
    return torch.cat([_step(model, cache, seq, ids, n, keep) for n in chunks]), cache, seq


def _poison(model: DeepseekV41ForCausalLM, cache: ContiguousV41Cache, seq: int, count: int) -> None:
    nan = torch.full((count, model.arch.head_dim), float("nan"))
    for layer in range(model.arch.yoco_boundary, model.arch.num_layers):
        cache._sequences[seq].sliding[layer].write(0, nan)


def _masked(model: DeepseekV41ForCausalLM, ids: torch.Tensor, floor: int) -> torch.Tensor:
    """DeepSeek's `mask` mode: every row through every layer, the same clipped windows."""
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    _poison(model, cache, seq, PROMPT)
    layout = StepLayout((0,), (PROMPT,))
    positions = torch.arange(PROMPT)
    every_row = BoundedReplay(layout, layout, positions, positions, (floor,))
    hidden = model.forward_cached(ids[:PROMPT], positions, layout, cache.step([seq], layout), None, every_row)
    return model.compute_logits(hidden)


def test_kept_rows_equal_every_row_with_the_same_windows(model):
    ids, keep = _ids(), 24
    floor = PROMPT - keep
    compact, _, _ = _prefill(model, ids, [PROMPT], keep)
    assert compact[:floor].isnan().all() and torch.isfinite(compact[floor:]).all()  # skipped: not computed
    masked = _masked(model, ids, floor)
    assert torch.isfinite(masked[floor:]).all()  # no consumer window read before the floor
    assert (compact[floor:] - masked[floor:]).abs().max() < TOL


def test_kept_rows_equal_the_unclipped_model_where_no_window_reaches_the_floor(model):
    """A row at p is exact once p >= floor + 3 * (W - 1): each consumer layer reaches W - 1
    further back (three from the boundary on here); the rows near the floor differ, as in
    DeepSeek (by less and less towards that bound: far keys weigh little)."""
    ids, keep = _ids(), 30
    floor = PROMPT - keep
    exact_from = floor + 3 * (model.arch.sliding_window - 1)
    compact, _, _ = _prefill(model, ids, [PROMPT], keep)
    full, _, _ = _prefill(model, ids, [PROMPT], None)
    assert (compact[exact_from:] - full[exact_from:]).abs().max() < TOL
    assert (compact[floor : floor + 4] - full[floor : floor + 4]).abs().amax(dim=1).min() > 1e-3


def test_chunks_equal_the_whole_prompt(model):
    """A chunk before the floor runs only its last row; later chunks read the earlier kept rows."""
    ids, keep = _ids(), 24
    floor = PROMPT - keep
    whole, _, _ = _prefill(model, ids, [PROMPT], keep)
    chunked, cache, seq = _prefill(model, ids, [7, 7, 7, 7, 12], keep)
    assert (chunked[floor:] - whole[floor:]).abs().max() < TOL
    assert torch.isfinite(chunked[6]).all() and chunked[:6].isnan().all()  # 0..6: its last row runs
    for layer in range(model.arch.yoco_boundary, model.arch.num_layers):  # but stores no row
        assert cache._sequences[seq].sliding[layer].data[:floor].isnan().all()


def test_decoding_after_replay_never_reads_a_skipped_row(model):
    """With keep >= W + B, decoding (unclipped windows) after rolling back B prompt tokens reads
    only kept rows: nothing turns NaN. Two tokens fewer would read a skipped one."""
    ids, window, backtrack = _ids(), model.arch.sliding_window, 4

    def decode_after_rollback(keep: int) -> torch.Tensor:
        _, cache, seq = _prefill(model, ids, [PROMPT], keep, backtrack)  # skipped rows: NaN
        cache.truncate(seq, PROMPT - backtrack)
        return torch.cat([_step(model, cache, seq, ids, 1, None) for _ in range(backtrack + 6)])

    assert torch.isfinite(decode_after_rollback(window + backtrack)).all()
    assert decode_after_rollback(window + backtrack - 2).isnan().any()


def test_decoding_after_replay_equals_decoding_after_the_full_prefill_when_keep_covers_the_reach(model):
    ids, keep = _ids(), 30  # decoding at p >= 40 reaches back to p - 21 >= floor + 9
    _, cache, seq = _prefill(model, ids, [PROMPT], keep)
    _, full_cache, full_seq = _prefill(model, ids, [PROMPT], None)
    replayed = torch.cat([_step(model, cache, seq, ids, 1, keep) for _ in range(6)])
    full = torch.cat([_step(model, full_cache, full_seq, ids, 1, None) for _ in range(6)])
    assert (replayed - full).abs().max() < TOL


def test_dspark_features_keep_the_step_rows(model, monkeypatch):
    """Features up to the boundary (its own: taken before it drops rows) are every row's; later
    ones are NaN where the row was skipped."""
    monkeypatch.setattr(model.layers[3], "feeds_dspark", True)  # the boundary too (tiny: 1, 4)
    ids, keep = _ids(), 24
    floor = PROMPT - keep
    layout = StepLayout((0,), (PROMPT,))
    got = {}
    for replay, features in ((None, {}), (BoundedReplay.plan(layout, (floor,), CPU), {})):
        cache = ContiguousV41Cache(model.arch)
        step = cache.step([cache.add_sequence()], layout)
        model.forward_cached(ids[:PROMPT], torch.arange(PROMPT), layout, step, features, replay)
        got[replay is None] = features
    full, compact = got[True], got[False]
    assert sorted(compact) == [1, 3, 4]
    assert torch.equal(compact[1], full[1]) and torch.equal(compact[3], full[3])
    assert compact[4][:floor].isnan().all() and torch.isfinite(compact[4][floor:]).all()


def test_off_changes_nothing(model):
    ids = _ids()
    off, _, _ = _prefill(model, ids, [PROMPT], None)
    everything_kept, _, _ = _prefill(model, ids, [PROMPT], PROMPT)  # floor 0: nothing skipped or clipped
    assert torch.equal(off, everything_kept)


def _engine_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=ENGINE_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _standalone_greedy(model: DeepseekV41ForCausalLM, prompt: list[int], keep: int) -> list[int]:
    """The prompt in one step under bounded replay, then greedy decoding one token at a time."""
    cache = ContiguousV41Cache(model.arch)
    seq = cache.add_sequence()
    out: list[int] = []
    chunk = prompt
    while len(out) < ENGINE_TOKENS:
        start = cache.length(seq)
        layout = StepLayout((start,), (len(chunk),))
        replay = BoundedReplay.plan(layout, prompt_floors(layout, (len(prompt),), keep), CPU)
        with torch.no_grad():
            hidden = model.forward_cached(
                torch.tensor(chunk),
                torch.arange(start, start + len(chunk)),
                layout,
                cache.step([seq], layout),
                None,
                replay,
            )
        out.append(int(model.compute_logits(hidden[-1:]).argmax()))
        chunk = out[-1:]
    return out


def test_engine_replays_as_the_standalone_model(tmp_path, monkeypatch):
    """On the paged cache, whole, in chunks of 7 and under preemption (recomputed with the same
    floors: the prompt's, not the sequence's length). Greedy tokens are robust on this model
    (off gives the same ones), so the planned replays are checked to skip rows."""
    vocab = build_tokenizer(tmp_path)
    tiny = build_v41(tmp_path, tiny_config(vocab_size=vocab), seed=4)
    keep = 8
    skipped = []
    plan = BoundedReplay.plan

    def spy(layout: StepLayout, floors: tuple[int, ...], device: torch.device) -> BoundedReplay:
        replay = plan(layout, floors, device)
        skipped.append(sum(layout.query_lens) - sum(replay.layout.query_lens))
        return replay

    def engine(**options: int) -> LLM:
        options.setdefault("num_blocks", 256)
        return LLM(
            model=str(tiny.path),
            block_size=4,
            num_threads=1,
            enable_prefix_caching=False,
            yoco_prefill_truncation="compact",
            yoco_prefill_keep_tokens=keep,
            **options,
        )

    llm = engine()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 23, 41, 64, 9)]
    expected = [_standalone_greedy(llm.engine.core.loaded.model, p, keep) for p in prompts]
    monkeypatch.setattr(BoundedReplay, "plan", staticmethod(spy))
    assert _engine_greedy(llm, prompts) == expected
    assert sum(skipped) == sum(len(p) - keep for p in prompts if len(p) > keep)  # one step: all
    _check_paged_logits(llm, prompts[3] + expected[3][:4], len(prompts[3]), keep)
    assert _engine_greedy(engine(prefill_chunk_size=7), prompts) == expected
    tight = engine(num_blocks=40, max_num_batched_tokens=32)
    assert _engine_greedy(tight, prompts) == expected
    assert tight.engine.core.num_preemptions > 0


def _check_paged_logits(llm: LLM, ids: list[int], prompt_len: int, keep: int) -> None:
    """The prompt in chunks of 7, then its continuation one by one, through the engine's runner
    and paged cache: the kept rows' and the continuation's logits within 1e-5 of the standalone
    model's (the prompt whole, then one by one)."""
    core = llm.engine.core
    seq = Sequence(-1, EngineRequest("paged", ids, SamplingParams()), 0, list(ids), prompt_len, b"")
    sizes = [7] * (prompt_len // 7) + [prompt_len % 7] + [1] * (len(ids) - prompt_len)
    got = []
    for size in filter(None, sizes):
        start = seq.num_computed_tokens
        core.kv.allocate(seq, size)
        span = RowSpan(core.runner.view.tables(seq), start, ids[start : start + size], prompt_len)
        _, _, logits = core.runner.run(ForwardWork([span], core.kv.take_copies(), list(range(size))))
        seq.num_computed_tokens += size
        got.append(logits)
    core.kv.free(seq)
    model = core.loaded.model
    cache = ContiguousV41Cache(model.arch)
    index = cache.add_sequence()
    expected = []
    for size in (prompt_len, *[1] * (len(ids) - prompt_len)):
        start = cache.length(index)
        layout = StepLayout((start,), (size,))
        replay = BoundedReplay.plan(layout, prompt_floors(layout, (prompt_len,), keep), CPU)
        step = cache.step([index], layout)
        with torch.no_grad():
            hidden = model.forward_cached(
                torch.tensor(ids[start : start + size]),
                torch.arange(start, start + size),
                layout,
                step,
                None,
                replay,
            )
        expected.append(model.compute_logits(hidden))
    got_all, expected_all, floor = torch.cat(got), torch.cat(expected), prompt_len - keep
    assert got_all[:floor].isnan().any()  # skipped (chunks before the floor ran their last rows)
    torch.testing.assert_close(got_all[floor:], expected_all[floor:], atol=TOL, rtol=0)


def test_keep_below_window_plus_backtrack_is_refused():
    check_keep_tokens(24, 8, 16)
    with pytest.raises(ConfigError, match=r"yoco_prefill_keep_tokens.*minimum 24"):
        check_keep_tokens(23, 8, 16)


def test_engine_option_is_validated_where_given():
    assert EngineConfig().yoco_prefill_truncation == "off"
    with pytest.raises(ConfigError, match="yoco_prefill_truncation"):
        EngineConfig.from_kwargs(yoco_prefill_truncation="mask")
    with pytest.raises(ConfigError, match="yoco_prefill_keep_tokens"):
        EngineConfig.from_kwargs(yoco_prefill_truncation="compact")
    with pytest.raises(ConfigError, match="yoco_prefill_keep_tokens"):
        EngineConfig.from_kwargs(yoco_prefill_keep_tokens=140)


def test_engine_refuses_replay_without_yoco_or_with_too_few_tokens(tmp_path):
    compact = EngineConfig.from_kwargs(
        yoco_prefill_truncation="compact", yoco_prefill_keep_tokens=7, device="cpu"
    )
    with pytest.raises(ConfigError, match=r"yoco_prefill_truncation.*no YoCo"):
        CausalLM.check_engine(ModelConfig.from_hf(_llama_raw()), compact)
    gguf = tmp_path / "model.gguf"  # a GGUF file is the Llama family: refused before it is read
    gguf.touch()
    with pytest.raises(ConfigError, match=r"yoco_prefill_truncation.*no YoCo"):
        check_model_engine(compact.replace(model=str(gguf)))
    v41 = ModelConfig.from_hf(_v41_raw(tmp_path))
    with pytest.raises(ConfigError, match=r"yoco_prefill_keep_tokens.*minimum 8"):
        DeepseekV41ForCausalLM.check_engine(v41, compact)
    with pytest.raises(ConfigError, match=r"enable_prefix_caching.*bounded replay"):
        DeepseekV41ForCausalLM.check_engine(v41, compact.replace(yoco_prefill_keep_tokens=8))
    DeepseekV41ForCausalLM.check_engine(
        v41, compact.replace(yoco_prefill_keep_tokens=8, enable_prefix_caching=False)
    )


def _v41_raw(tmp_path: Path) -> dict:
    import json

    build_v41(tmp_path / "cfg", tiny_config(), seed=0)
    return json.loads((tmp_path / "cfg" / "config.json").read_text())


def _llama_raw() -> dict:
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 128,
    }
