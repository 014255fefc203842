"""Linear layers at SmolLM2-135M's shapes: torch in fp32, torch in bf16 (oneDNN; AVX512-BF16 or AMX
where the CPU has them) and our bf16 kernel (kernels/bf16_matmul.c, built for this CPU's level),
alternating in one run so a busy machine's noise hits all three. Where our kernel runs on AMX
tiles it is also timed on the VDPBF16PS path (the `avx512_bf16` build), a fourth column.

    .venv/bin/python -m deepinfer.bench.bf16_linear [--threads 1] [--rounds 5] [--rows 1 32 512]

Prints, per projection and row count, the median time of each and two ratios: torch bf16 over
fp32 (below 1: bf16 is faster; `dtype=auto`, model/loader/dtype.py, rests on it) and ours over
torch bf16. Our kernel runs on torch's OpenMP threads (the same libgomp), so `--threads` sets both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer.kernels import isa
from deepinfer.kernels.bf16_matmul import bf16_kernels, pack

# SmolLM2-135M: hidden 576, MLP 1536, 9 query + 2 x 3 KV heads of 64, vocabulary 49152
SHAPES = {
    "qkv 576->960": (960, 576),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (3072, 576),
    "down 1536->576": (576, 1536),
    "lm_head 576->49152": (49152, 576),
}


def seconds(
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor, reps: int
) -> float:
    linear(x, w)  # oneDNN builds its kernel for the shape on the first call
    start = time.perf_counter()
    for _ in range(reps):
        linear(x, w)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernels = bf16_kernels()
    if kernels is None:
        raise SystemExit("no C compiler: our kernel cannot be built")
    vector = bf16_kernels(isa.compiler_flags("avx512_bf16")) if kernels.amx_status == 1 else None
    print(f"torch {torch.__version__}, {args.threads} thread(s), our tiles: {kernels.amx_status == 1}")
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k) / k**0.5
        w16 = w32.bfloat16()
        packed = pack(w16)
        for m in args.rows:
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            reps = max(2, min(1000, int(4e8 / (m * n * k))))  # ~0.1-1 s per measurement
            fp32, bf16, ours, vdp = [], [], [], []
            for _ in range(args.rounds):
                fp32.append(seconds(F.linear, x32, w32, reps))
                bf16.append(seconds(F.linear, x16, w16, reps))
                ours.append(seconds(lambda x, w, n=n: kernels.linear(x, w, n), x16, packed, reps))
                if vector is not None:
                    vdp.append(seconds(lambda x, w, n=n: vector.linear(x, w, n), x16, packed, reps))
            a, b, c = (statistics.median(t) for t in (fp32, bf16, ours))
            tiles = f"  VDPBF16PS {statistics.median(vdp) * 1e6:9.1f} us" if vdp else ""
            print(
                f"{name:20s} M={m:<4d} fp32 {a * 1e6:9.1f} us  bf16 {b * 1e6:9.1f} us  ours {c * 1e6:9.1f} us"
                f"{tiles}  bf16/fp32 {b / a:.2f}  ours/bf16 {c / b:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
