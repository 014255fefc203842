"""Async scheduling on the real default model: the same greedy tokens as the synchronous engine
(batched, chunked prefill, n > 1, stops, max_tokens, structured output, preemption, an abort
mid-stream), and every KV block free at the end. Options it cannot serve are refused."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputs
from deepinfer.config import EngineConfig
from deepinfer.config.fields import ConfigError

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ("Name a fruit.", "Count to five.", "Say hello in French.", "What is 2+2?", "Name a color.")


def _engines(default_llm, **options) -> tuple[LLM, LLM]:
    """A synchronous and an asynchronous engine over the default model's loaded weights."""
    loaded = default_llm.engine.core.loaded
    options = {"kv_cache_memory": 32 << 20, **options}
    return (
        LLM(loaded=loaded, **options),
        LLM(loaded=loaded, async_scheduling=True, **options),
    )


def _requests(llm: LLM) -> tuple[list, list[SamplingParams]]:
    prompts = [CHAT.format(q) for q in QUESTIONS] + ["Once upon a time"] * 3
    regex = StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}")
    params = [
        SamplingParams(temperature=0, max_tokens=24),  # ends at EOS
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # ends by length
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=8, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, structured_outputs=regex),
        SamplingParams(temperature=0, max_tokens=16, stop=[" the"], ignore_eos=True),  # a stop string
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[11], ignore_eos=True),  # ","
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
    ]
    # A long prompt, chunked by prefill_chunk_size over several steps while others decode.
    prompts.append(CHAT.format("Summarize: " + "the quick brown fox jumps over the lazy dog " * 5))
    params.append(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return prompts, params


def _completions(llm: LLM) -> list[list[tuple[list[int], str, str | None]]]:
    prompts, params = _requests(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def test_async_outputs_equal_synchronous(default_llm):
    """Few KV blocks, so sequences are preempted (some with a step in flight) and recomputed."""
    sync, async_ = _engines(default_llm, prefill_chunk_size=16, num_blocks=10)
    expected = _completions(sync)
    assert _completions(async_) == expected
    assert expected[5][0][2] == "stop" and expected[1][0][2] == "length"
    assert async_.engine.core.num_preemptions > 0  # the preemption path really ran
    for llm in (sync, async_):
        assert llm.engine.core.kv.num_used_blocks == 0
        llm.close()


def test_abort_mid_stream(default_llm):
    sync, async_ = _engines(default_llm)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kept = {}
    for llm in (sync, async_):
        engine = llm.engine
        ids = [engine.add_request(CHAT.format(q), params) for q in QUESTIONS[:3]]
        for _ in range(4):
            engine.step()
        engine.abort_request(ids[1])
        texts = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts[out.request_id] = out.outputs[0].token_ids
        assert ids[1] not in texts and len(texts) == 2
        kept[llm is async_] = [texts[ids[0]], texts[ids[2]]]
        assert engine.core.kv.num_used_blocks == 0 and not engine.core.has_work()
        llm.close()
    assert kept[True] == kept[False]


@pytest.mark.parametrize(
    "options",
    [
        {"speculative_method": "ngram"},
        {"kv_store": "/tmp/deepinfer-async-kv"},
        {"role": "prefill"},
        {"data_parallel_size": 2},
    ],
)
def test_unsupported_combinations_are_refused(options):
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig.from_kwargs(async_scheduling=True, **options)
