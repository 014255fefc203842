"""SmolLM2 (the embedded GGUF) dequantized to fp32 against HF transformers loading the same GGUF file."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model(default_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token
    return model.eval()


def test_logits_match_hf(dense_llm, hf_model):
    tokenizer = dense_llm.get_tokenizer()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = dense_llm.engine.core.score(ids)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0]
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


GREEDY_TOKENS = 32  # HF's own generate is most of this test's time


def test_greedy_continuations_match_hf(dense_llm, hf_model):
    tokenizer = dense_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = dense_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == expected
