"""The engine on the Triton backend runs its layers' norms and rotary and its sampler's truncation,
draw and grammar bitmask through kernels/triton (interpreted on the CPU), with the C kernel
backend's tokens: greedy, seeded sampling, and a regex constraint, on a
tiny Qwen3 (QK-norm: the per-head norm takes the same switch)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from transformers import Qwen3Config

from deepinfer import LLM, SamplingParams
from deepinfer.kernels.triton import bitmask, rms_norm, rotary, sampling
from deepinfer.model.loader.source import converted_gguf_dir
from deepinfer.sampling_params import StructuredOutputs
from tests.engine.test_parity_tiny import COMMON, make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_path):
    directory = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True, use_sliding_window=False)
    make_checkpoint("qwen3-qk-norm", directory, converted_gguf_dir(default_model_path), config)
    return directory


def _count_calls(monkeypatch, calls: Counter) -> None:
    """Count the kernels' entry points where the layers and the sampler look them up."""
    for module, name in (
        (rms_norm, "rms_norm"),
        (rotary, "rotary_"),
        (sampling, "truncated_probs"),
        (sampling, "draw"),
        (bitmask, "apply_bitmask_"),
    ):
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _k=kernel, _n=name, **kw: calls.update([_n]) or _k(*a, **kw)
        )


def test_layers_and_sampler_run_on_the_triton_kernels(checkpoint, device, monkeypatch):
    calls: Counter = Counter()
    _count_calls(monkeypatch, calls)
    prompts = [[(13 * i + 7 * j) % 48000 + 100 for j in range(5 + 4 * i)] for i in range(2)]
    options = dict(model=str(checkpoint), dtype="float32", block_size=4, num_blocks=64, num_threads=1)
    cpu = LLM(attention_backend="cpu_paged", device="cpu", **options)
    gpu_path = LLM(attention_backend="triton", device=device, **options)
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        # min-p only: the interpreter takes seconds per top-k / top-p bisection over a 49k vocabulary
        # (test_sampling.py covers those on a small one)
        SamplingParams(temperature=0.9, min_p=0.02, seed=11, max_tokens=4, ignore_eos=True),
    ]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputs(regex=r"[0-9]{2}-[0-9]")
    )

    def run(llm: LLM) -> tuple[list[list[int]], str]:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}],
            [*params, constrained],
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outputs], outputs[-1].outputs[0].text

    expected, expected_text = run(cpu)
    assert not calls  # the C kernel backend never touches them
    tokens, text = run(gpu_path)
    assert tokens == expected
    assert re.fullmatch(r"[0-9]{2}-[0-9]", text) and text == expected_text
    # every layer norm, both QK norms and the final norm; rotary once per layer and step
    assert calls["rms_norm"] > 0 and calls["rotary_"] > 0
    assert calls["truncated_probs"] == calls["draw"] > 0
    assert calls["apply_bitmask_"] > 0
