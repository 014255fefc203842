"""Micro-benchmark of the GGUF block kernels (quantization="gguf") against this machine's roofline.

    .venv/bin/python -m deepinfer.bench.gguf_kernels [--threads 2] [--repeats 20]

- the default model's own projections (Q4_1 layers, the Q8_0 tied head) at M = 1 (batch-1
  decode), 8, 32 (decode batches) and 128, 512 (prefill chunks), in the file's block layout and
  interleaved eight rows at a time (what the engine computes on), and where the CPU has AMX the
  interleaved product kept off the tiles (the VNNI path), beside fp32 `F.linear` on the same
  weights dequantized (what quantization="none" runs);
- one decode pass over every projection of the model (30 layers and the head) at M = 1, the
  weight-reading part of a batch-1 step, with its tok/s ceiling, in both layouts;
- each format on one synthetic 4096 x 1024 matrix at M = 1 and 32 (interleaved where it can be);
- the roofline as `bench roofline` measures it: best copy/add bandwidth and fp32 GEMM peak.
GB/s counts the packed weight bytes read once per call; GOP/s counts 2·M·N·K. Times are the best
of `--repeats` calls after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer.bench.roofline import measure_roofline
from deepinfer.kernels.gguf_blocks import PACKED_TYPES, PackedGroup, PackedMatrix, gguf_kernels
from deepinfer.model.loader.gguf_tensors import read_tensors
from deepinfer.model.loader.source import default_model_path

M_VALUES = (1, 8, 32, 128, 512)


def _best(action: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        action()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - start)
    return best


def _matrix(tensor) -> PackedMatrix:
    return PackedMatrix(int(tensor.tensor_type), tensor.rows, tensor.shape[0], tensor.data)


def _dense(group: PackedGroup) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    parts = [quants.dequantize(m.data, GGMLQuantizationType(m.qtype)) for m in group.matrices]
    return torch.from_numpy(np.concatenate(parts).astype(np.float32))


def model_groups() -> dict[str, list[PackedGroup]]:
    tensors = {t.name: t for t in read_tensors(default_model_path())}
    layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))

    def group(*names: str) -> PackedGroup:
        return PackedGroup([_matrix(tensors[name]) for name in names])

    groups: dict[str, list[PackedGroup]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for i in range(layers):
        b = f"blk.{i}."
        groups["qkv"].append(group(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"))
        groups["o"].append(group(b + "attn_output.weight"))
        groups["gate_up"].append(group(b + "ffn_gate.weight", b + "ffn_up.weight"))
        groups["down"].append(group(b + "ffn_down.weight"))
    groups["head"] = [group("token_embd.weight")]
    return groups


def _row(
    label: str,
    m: int,
    group: PackedGroup,
    file_seconds: float,
    seconds: float,
    vector_seconds: float,
    dense_seconds: float,
) -> str:
    gbs = group.nbytes / seconds / 1e9
    gops = 2 * m * group.rows * group.cols / seconds / 1e9
    return (
        f"| {label} | {m} | {file_seconds * 1e3:.3f} | {seconds * 1e3:.3f} | {vector_seconds * 1e3:.3f} | "
        f"{gbs:.1f} | {gops:.1f} | "
        f"{dense_seconds * 1e3:.3f} | {dense_seconds / seconds:.2f}× |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("DEEPINFER_BENCH_THREADS", 2)))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = gguf_kernels()
    if kernels is None:
        raise SystemExit("no C compiler: the GGUF kernels cannot be built")
    amx = {1: "in use", 0: "not built", -1: "refused by the OS", -2: "off (differed from VNNI)"}
    print(
        f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, SIMD level {kernels.simd_level}, "
        f"AMX tiles {amx[kernels.amx_status]}"
    )
    roof = measure_roofline(threads=args.threads)
    print(
        f"roofline: bandwidth {roof.peak_bytes_per_s / 1e9:.1f} GB/s (copy {roof.copy_bytes_per_s / 1e9:.1f}, "
        f"add {roof.add_bytes_per_s / 1e9:.1f}), fp32 GEMM peak {roof.peak_flops / 1e9:.1f} GFLOP/s\n"
    )
    file_groups = model_groups()
    groups = {
        name: [PackedGroup([kernels.interleave(m) for m in g.matrices]) for g in items]
        for name, items in file_groups.items()
    }
    print(
        "| projection (layer 0) | M | file layout ms | interleaved ms | interleaved, no tiles ms | GB/s "
        "| GOP/s | fp32 F.linear ms | speed-up over fp32 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, items in groups.items():
        group, file_group = items[0], file_groups[name][0]
        dense = _dense(file_group)
        fmt = "+".join(sorted({_TYPE_NAMES[m.qtype] for m in file_group.matrices}))
        for m in M_VALUES:
            x = torch.randn(m, group.cols)
            seconds = _best(lambda x=x, group=group: kernels.matmul(x, group), args.repeats)
            file_seconds = _best(lambda x=x, group=file_group: kernels.matmul(x, group), args.repeats)
            vector_seconds = seconds
            if kernels.amx_status == 1 and m >= 16:
                vector_seconds = _best(
                    lambda x=x, group=group: kernels.matmul(x, group, tiles=False), args.repeats
                )
            dense_seconds = _best(lambda x=x, dense=dense: F.linear(x, dense), args.repeats)
            print(
                _row(
                    f"{name} {group.rows}×{group.cols} {fmt}",
                    m,
                    group,
                    file_seconds,
                    seconds,
                    vector_seconds,
                    dense_seconds,
                )
            )

    for label, layout in (("file layout", file_groups), ("interleaved", groups)):
        every = [g for items in layout.values() for g in items]
        inputs = {g.cols: torch.randn(1, g.cols) for g in every}
        total = sum(g.nbytes for g in every)
        seconds = _best(
            lambda every=every, inputs=inputs: [kernels.matmul(inputs[g.cols], g) for g in every],
            max(3, args.repeats // 4),
        )
        print(
            f"\ndecode pass ({label}), every projection at M = 1: {seconds * 1e3:.2f} ms for "
            f"{total / 2**20:.1f} MiB = {total / seconds / 1e9:.1f} GB/s ({total / seconds / roof.peak_bytes_per_s:.0%} "
            f"of the roofline bandwidth); ceiling {1 / seconds:.0f} tok/s for the weights alone"
        )
    print()

    rng = np.random.default_rng(0)
    print("| format, 4096×1024 | M | ms | GB/s | GOP/s |")
    print("| --- | --- | --- | --- | --- |")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for its tests/
    from tests.kernels.gguf_testing import random_packed  # the blocks the kernel tests use

    for name in PACKED_TYPES:
        group = PackedGroup([kernels.interleave(random_packed(name, 4096, 1024, rng))])
        for m in (1, 32):
            x = torch.randn(m, 1024)
            seconds = _best(lambda x=x, group=group: kernels.matmul(x, group), args.repeats)
            gbs, gops = group.nbytes / seconds / 1e9, 2 * m * 4096 * 1024 / seconds / 1e9
            print(f"| {name} | {m} | {seconds * 1e3:.3f} | {gbs:.1f} | {gops:.1f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


_TYPE_NAMES = {qtype: name for name, qtype in PACKED_TYPES.items()}

if __name__ == "__main__":
    main()
