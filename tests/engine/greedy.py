"""Checks on the real default model shared by the tests of its numeric modes (int8, fp16 KV)."""

from __future__ import annotations

from deepinfer import LLM, SamplingParams

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ("Name a fruit.", "Count to five.", "Say hello in French.", "What is 2+2?")


def assert_greedy_batch_invariant(llm: LLM, max_tokens: int = 24) -> None:
    """Greedy tokens of four chat prompts are the same run together and one at a time."""
    prompts = [CHAT.format(q) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.reset_prefix_cache()
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == batched
