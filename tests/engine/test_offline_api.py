"""The offline API end to end on the default model: sampling, stops, n > 1, bad input, leaks."""

from __future__ import annotations

import pytest

from deepinfer import SamplingParams
from deepinfer.sampling_params import InvalidRequestError

PROMPT = "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n"
OTHERS = ["The weather today is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


def test_seeded_sampling_reproduces_across_batch_compositions(default_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = default_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = (
        default_llm.generate(
            [OTHERS[0], PROMPT, OTHERS[1]],
            [
                SamplingParams(temperature=1.0, max_tokens=30),
                params,
                SamplingParams(temperature=0.7, seed=5, max_tokens=8),
            ],
            use_tqdm=False,
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=24)
    assert default_llm.generate(PROMPT, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_spanning_tokens_is_excluded(default_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = default_llm.generate(OTHERS[2], greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = default_llm.get_tokenizer()
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # A stop string that starts inside one token and ends inside the next.
    i = next(
        i
        for i in range(1, len(pieces) - 1)
        if len(pieces[i].strip()) >= 3 and len(pieces[i + 1].strip()) >= 3
    )
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    position = full.text.index(stop)
    assert position < len("".join(pieces[: i + 1])) < position + len(stop)  # it really spans two tokens
    out = default_llm.generate(
        OTHERS[2], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == full.text[:position]
    kept = default_llm.generate(
        OTHERS[2],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full.text[: position + len(stop)]


def test_stop_token_ids_and_max_tokens(default_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    full = default_llm.generate(OTHERS[2], greedy, use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_id = full.token_ids[4]
    out = default_llm.generate(
        OTHERS[2], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert (
        out.finish_reason == "stop"
        and out.stop_reason == stop_id
        and out.token_ids == full.token_ids[: first + 1]
    )


def test_min_tokens_defers_eos(default_llm):
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.finish_reason == "stop"  # the model ends its answer with EOS
    forced = default_llm.generate(
        PROMPT,
        SamplingParams(temperature=0.0, max_tokens=200, min_tokens=len(out.token_ids) + 5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(forced.token_ids) >= len(out.token_ids) + 5


def test_n_choices_share_the_prompt_and_differ(default_llm):
    out = default_llm.generate(
        PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    again = default_llm.generate(
        PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16), use_tqdm=False
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert default_llm.engine.core.kv.num_used_blocks == 0


def test_logprobs_are_returned_per_token(default_llm):
    out = default_llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False
    )[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position and position[token_id].rank == 1  # greedy picks the top token
        assert len(position) == 3
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
    )


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**9], SamplingParams(), "prompt"),
        ([5] * 9000, SamplingParams(), "prompt"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(temperature=-0.1), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(n=0), "n"),
        ("hi", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
    ],
)
def test_bad_input_names_the_field_and_leaves_others_running(default_llm, prompt, params, field):
    with pytest.raises(InvalidRequestError) as info:
        default_llm.generate(["A fine prompt", prompt], params, use_tqdm=False)
    assert info.value.param == field and field in str(info.value)
    assert not default_llm.engine.has_unfinished_requests()  # nothing half-admitted
    ok = default_llm.generate("A fine prompt", SamplingParams(max_tokens=2), use_tqdm=False)
    assert ok[0].outputs[0].finish_reason in ("stop", "length")


def test_abort_frees_every_block(default_llm):
    engine = default_llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in OTHERS]
    engine.step()
    engine.step()
    for request_id in ids[:2]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
        if engine.core.kv.num_used_blocks:
            for request_id in ids[2:]:
                engine.abort_request(request_id)
    assert engine.core.kv.num_used_blocks == 0
    assert engine.core.kv.num_free_blocks == engine.core.num_blocks


def test_token_id_prompts_and_num_cached_tokens(default_llm):
    tokenizer = default_llm.get_tokenizer()
    ids = tokenizer.encode(PROMPT * 3)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    first = default_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    second = default_llm.generate([ids], params, use_tqdm=False)[0]
    assert first.prompt_token_ids == ids and first.prompt is None
    assert second.num_cached_tokens >= (len(ids) - 1) // 16 * 16 - 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
