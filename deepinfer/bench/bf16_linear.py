"""torch's linear layers in bf16 (oneDNN; AVX512-BF16 or AMX where the CPU has them) against fp32,
at SmolLM2-135M's shapes, alternating the two in one run so a busy machine's noise hits both.

    .venv/bin/python -m deepinfer.bench.bf16_linear [--threads 1] [--rounds 5] [--rows 1 32 512]

Prints, per projection and row count, the median time of each dtype and bf16's time over fp32's
(below 1: bf16 is faster). `dtype=auto` (model/loader/dtype.py) rests on these figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# SmolLM2-135M: hidden 576, MLP 1536, 9 query + 2 x 3 KV heads of 64, vocabulary 49152
SHAPES = {
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def seconds(x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    F.linear(x, w)  # oneDNN builds its kernel for the shape on the first call
    start = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k) / k**0.5
        w16 = w32.bfloat16()
        for m in args.rows:
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            reps = max(2, min(1000, int(4e8 / (m * n * k))))  # ~0.1-1 s per measurement
            fp32, bf16 = [], []
            for _ in range(args.rounds):
                fp32.append(seconds(x32, w32, reps))
                bf16.append(seconds(x16, w16, reps))
            a, b = statistics.median(fp32), statistics.median(bf16)
            print(
                f"{name:20s} M={m:<4d} fp32 {a * 1e6:9.1f} us  bf16 {b * 1e6:9.1f} us  bf16/fp32 {b / a:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
