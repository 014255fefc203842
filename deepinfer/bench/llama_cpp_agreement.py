"""How our greedy outputs compare with llama.cpp's on the 16 held prompts (no llama.cpp needed).

    .venv/bin/python -m deepinfer.bench.llama_cpp_agreement [--quantization gguf,none] [--kv-cache-dtype float16]

Reads tests/engine/data/llama_cpp_greedy.json (deepinfer/bench/llama_cpp_greedy_reference.py writes it)
and reports, per numeric mode: how many of our greedy continuations (up to 32 tokens, ending at
an end token) equal llama.cpp's, where each first differs, and teacher-forced along llama.cpp's
tokens how often our top-1 is its token, with the gaps (nats) where it is not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "engine" / "data" / "llama_cpp_greedy.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="gguf,none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    fixture = json.loads(FIXTURE.read_text())
    cases = fixture["cases"]
    print(f"fixture: {fixture['llama_cpp']}, {fixture['date']}, `{fixture['command']}`")
    for mode in args.quantization.split(","):
        llm = LLM(kv_cache_memory=64 << 20, quantization=mode, kv_cache_dtype=args.kv_cache_dtype)
        ends = set(llm.get_tokenizer().eos_token_ids)
        params = SamplingParams(temperature=0, max_tokens=fixture["new_tokens"])
        outputs = llm.generate([c["prompt_ids"] for c in cases], params, use_tqdm=False)
        first_differences = []
        for output, case in zip(outputs, cases):
            ours = [t for t in output.outputs[0].token_ids if t not in ends]
            theirs = case["llama_cpp_tokens"]
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if first is None and len(ours) != len(theirs):
                first = min(len(ours), len(theirs))
            first_differences.append(first)
        agree = total = 0
        gaps = []
        for case in cases:
            prompt, expected = case["prompt_ids"], case["llama_cpp_tokens"]
            logprobs = torch.log_softmax(llm.engine.core.score(prompt + expected), dim=-1)
            logprobs = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(expected)]
            target = torch.tensor(expected)
            top = logprobs.argmax(-1)
            agree += int((top == target).sum())
            total += len(expected)
            gap = logprobs.max(-1).values - logprobs.gather(1, target[:, None]).squeeze(1)
            gaps += gap[top != target].tolist()
        same = sum(f is None for f in first_differences)
        print(
            f"quantization={mode} kv={args.kv_cache_dtype}: {same}/16 continuations equal llama.cpp's; "
            f"first difference at {['=' if f is None else f for f in first_differences]}; teacher-forced "
            f"top-1 = llama.cpp's token at {agree}/{total} positions ({agree / total:.1%}), gaps where not "
            f"(nats): max {max(gaps, default=0):.3f}, median {sorted(gaps)[len(gaps) // 2] if gaps else 0:.3f}"
        )
        llm.close()


if __name__ == "__main__":
    main()
