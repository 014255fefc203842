"""End to end with the real model at temperature 1.0: every finished output validates."""

from __future__ import annotations

import json
import re

import pytest

from tests.structured.schemas import SUITE, UNSUPPORTED
from tests.structured.validation import strict_validator

SAMPLES_PER_SCHEMA = 1
MAX_TOKENS = 256


def _prompt(llm, schema: dict) -> list[int]:
    messages = [
        {
            "role": "user",
            "content": f"Reply with one JSON value that matches this JSON Schema:\n{json.dumps(schema)}",
        }
    ]
    return llm.render_chat(messages)


def test_generated_json_always_validates(default_llm):
    """Every schema of the suite (46), one sample each at temperature 1.0, all in one batch."""
    from deepinfer import SamplingParams, StructuredOutputs

    prompts, params, names = [], [], []
    for name, schema in SUITE.items():
        for seed in range(SAMPLES_PER_SCHEMA):
            prompts.append(_prompt(default_llm, schema))
            params.append(
                SamplingParams(
                    structured_outputs=StructuredOutputs(json=schema),
                    temperature=1.0,
                    seed=seed,
                    max_tokens=MAX_TOKENS,
                )
            )
            names.append(name)
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    cut = []
    for name, out in zip(names, outputs, strict=True):
        completion = out.outputs[0]
        if completion.finish_reason != "stop":
            # Cut by max_tokens (a long free string at temperature 1.0): a prefix of valid JSON.
            assert completion.finish_reason == "length", completion.finish_reason
            cut.append(name)
            continue
        value = json.loads(completion.text)
        errors = [e.message for e in strict_validator(SUITE[name]).iter_errors(value)]
        assert not errors, f"{name}: {completion.text!r}: {errors}"
    # The 135M model at temperature 1.0 runs on in 4-5 of these 46 whatever the KV dtype (endless
    # digits of a number or of a fractional second, a free string); a grammar that trapped
    # generation would cut far more than a sixth.
    assert len(cut) <= len(outputs) // 6, f"{len(cut)} of {len(outputs)} cut by max_tokens: {cut}"


def test_choice_and_regex(default_llm):
    from deepinfer import SamplingParams, StructuredOutputs

    prompt = default_llm.render_chat([{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    choice = SamplingParams(
        structured_outputs=StructuredOutputs(choice=["yes", "no"]), temperature=1.0, seed=1
    )
    regex = SamplingParams(
        structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
        temperature=1.0,
        seed=2,
        max_tokens=20,
    )
    out_choice, out_regex = default_llm.generate([prompt, prompt], [choice, regex], use_tqdm=False)
    assert out_choice.outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out_regex.outputs[0].text)


def test_unsupported_schema_is_a_clear_error(default_llm):
    from deepinfer import SamplingParams, StructuredOutputs
    from deepinfer.sampling_params import InvalidRequestError

    schema, keyword = UNSUPPORTED["dependent_required"]
    params = SamplingParams(structured_outputs=StructuredOutputs(json=schema), max_tokens=8)
    with pytest.raises(InvalidRequestError, match=keyword):
        default_llm.generate(["hi"], params, use_tqdm=False)
