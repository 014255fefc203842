"""Several tokens per step reach the output processor: a stop string completed by one of them
drops the tokens after it, as if generation had stopped there."""

from __future__ import annotations

from deepinfer.engine.outputs import SequenceOutput, TokenLogprobs
from deepinfer.frontend.output_processor import OutputProcessor
from deepinfer.sampling_params import SamplingParams


def test_stop_string_in_the_middle_of_a_multi_token_step(default_llm):
    tokenizer = default_llm.get_tokenizer()
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=[" jumps over"], logprobs=0)
    processor.add_request("r", None, tokenizer.encode("Say:"), params)
    first, rest = tokenizer.encode(" The quick"), tokenizer.encode(" brown fox jumps over the lazy dog")
    processor.process([SequenceOutput("r", 0, first, logprobs=[TokenLogprobs(-0.1, 1)] * len(first))])
    logprobs = [TokenLogprobs(-float(i), 1) for i in range(len(rest))]
    deltas, to_abort = processor.process([SequenceOutput("r", 0, rest, logprobs=logprobs)])
    (delta,) = deltas
    over = next(i for i in range(len(rest)) if tokenizer.decode(rest[: i + 1]).endswith(" over"))
    assert over < len(rest) - 1  # the stop string completes before the step's last token
    assert delta.token_ids == rest[: over + 1]
    assert len(delta.logprobs) == over + 1
    # The first step's text was held back (it could have begun the stop string).
    assert (
        delta.text == " The quick brown fox"
        and delta.finish_reason == "stop"
        and delta.stop_reason == " jumps over"
    )
    assert to_abort == [("r", 0)]
    output = processor.request_output("r")
    assert output.outputs[0].text == " The quick brown fox"
    assert output.outputs[0].token_ids == first + rest[: over + 1]


def test_multi_token_step_without_a_stop_is_kept_whole(default_llm):
    tokenizer = default_llm.get_tokenizer()
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, tokenizer.encode("Say:"), SamplingParams(stop=["zebra"]))
    tokens = tokenizer.encode(" one two three four")
    deltas, to_abort = processor.process([SequenceOutput("r", 0, tokens, finish_reason="length")])
    assert deltas[0].token_ids == tokens and deltas[0].text == " one two three four"
    assert deltas[0].finish_reason == "length" and to_abort == []
