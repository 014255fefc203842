"""Steps 5 and 6 of sampling on the CPU: one decode step's tokens (and logprobs) for a batch of
rows, through the sampler as the engine calls it (rowwise.c's `draw_rows` and `logprob_rows`) and
through the torch path they replaced (`truncated_probs_batch` then `sample_rows`, which still run
without a C compiler; log_softmax, a rank and a topk per row).

    .venv/bin/python -m deepinfer.bench.sampling [--rows 32] [--vocab 49152] [--repeats 30]

Each setting (a temperature alone, then top-p, top-k and min-p on top of it; greedy rows that ask
for 5 logprobs, rowwise.c's `logprob_rows` against torch's log_softmax, rank and topk) prints the mean
milliseconds per step of both paths, alternated in one process, and their ratio. The logits are
random normal times 3, SmolLM2's vocabulary by default; nothing else runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from deepinfer.runner.sampler import Sampler, SamplingRow, sample_rows, truncated_probs_batch
from deepinfer.sampling_params import SamplingParams

SETTINGS: dict[str, dict[str, float | int]] = {
    "temperature 0.8": {"temperature": 0.8},
    "+ top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "+ top_k 40": {"temperature": 0.8, "top_k": 40},
    "+ min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "greedy, logprobs 5": {"temperature": 0.0, "logprobs": 5},
}


def _mean_ms(action: Callable[[], object], repeats: int) -> float:
    action()
    start = time.perf_counter()
    for _ in range(repeats):
        action()
    return (time.perf_counter() - start) / repeats * 1e3


def _torch_path(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """Step 6 as torch ran it: greedy rows' argmax, or truncation then the float64 CDF's draw;
    then the logprobs rows' log_softmax, rank and top-k, one row at a time."""
    if params[0].greedy:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = sample_rows(truncated_probs_batch(logits, params), [None] * len(params))
    if params[0].logprobs is not None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, token in enumerate(tokens):
            _ = int((logprobs[i] > logprobs[i, token]).sum()) + 1, torch.topk(logprobs[i], params[i].logprobs)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3.0
    sampler = Sampler()
    print(f"{args.rows} rows x {args.vocab} logits, {args.threads} threads: ms per step")
    print("| setting | torch path | the sampler | ratio |")
    print("| --- | --- | --- | --- |")
    for name, setting in SETTINGS.items():
        rows = [SamplingRow(SamplingParams(**setting), [], []) for _ in range(args.rows)]
        params = [row.params for row in rows]
        torch_path = partial(_torch_path, logits, params)
        engine_path = partial(sampler, logits, rows)
        before, after = [], []
        for _ in range(3):  # alternated: the machine's speed drifts
            before.append(_mean_ms(torch_path, args.repeats))
            after.append(_mean_ms(engine_path, args.repeats))
        old, new = min(before), min(after)
        print(f"| {name} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
