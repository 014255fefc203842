"""Decode steps of a Llama-3.1-8B-shaped model built from random values, on one CUDA device,
through the GPU path's kernels, against the HBM roofline. Run by deepinfer/bench/device_check.sh.

The step is the Llama decoder written out over the engine's paged KV cache: Triton RMSNorm +
residual, Triton rotary, the Triton attention backend (attention/triton_backend.py) and cuBLAS
for the linears. It needs only torch and triton (the device machine has no network and none of
the engine's other dependencies), so it does not load a checkpoint or run the scheduler.
`--kernels torch` runs the same step with the PyTorch reference of each kernel, and every run
first compares one step of both (the largest logit difference and whether the greedy tokens agree).

Bytes per step (decode is memory bound): every weight matrix once per step (the embedding only
for the batch's rows), plus each sequence's K and V for its context:

    bytes = sum(matrices) + B * L * 2 * n_kv * d * context * 2 (bf16)

and the roofline time is bytes / bandwidth, for the device's nominal HBM bandwidth (--hbm-gbps,
4800 for an H200) and for a measured device-to-device copy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.attention.backend import TorchReferenceBackend
from deepinfer.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=300)
BLOCK_SIZE = 16


class RandomLlama:
    """Weights drawn at std 0.02 (norm weights 1), the fused layouts the engine uses."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, max_positions: int) -> None:
        self.shape = shape
        s = shape
        qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim

        def matrix(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, device=device, dtype=dtype) * 0.02).contiguous()

        self.embed = matrix(s.vocab, s.hidden)
        self.layers = [
            dict(
                norm1=torch.ones(s.hidden, device=device, dtype=dtype),
                qkv=matrix(qkv_rows, s.hidden),
                o=matrix(s.hidden, s.heads * s.head_dim),
                norm2=torch.ones(s.hidden, device=device, dtype=dtype),
                gate_up=matrix(2 * s.intermediate, s.hidden),
                down=matrix(s.hidden, s.intermediate),
            )
            for _ in range(s.layers)
        ]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = matrix(s.vocab, s.hidden)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, head_dim]
        self.cos = emb.cos().to(device, dtype)
        self.sin = emb.sin().to(device, dtype)

    def matrix_bytes(self) -> int:
        matrices = [self.lm_head] + [
            layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")
        ]
        return sum(m.numel() * m.element_size() for m in matrices)


def _rotary_torch(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    c, s = cos[positions, :half].unsqueeze(1), sin[positions, :half].unsqueeze(1)
    x1, x2 = x[..., :half].clone(), x[..., half:].clone()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s


def _rms_norm_torch(x, weight, eps, residual=None):
    total = x if residual is None else x + residual
    return F.rms_norm(total, weight.shape, weight, eps), total


class Step:
    """One decode step of the model over a paged cache, with Triton kernels or their references."""

    def __init__(self, model: RandomLlama, caches: list[torch.Tensor], kernels: str) -> None:
        self.model, self.caches = model, caches
        if kernels == "triton":
            from deepinfer.attention.triton_backend import TritonBackend
            from deepinfer.kernels.triton.rms_norm import rms_norm
            from deepinfer.kernels.triton.rotary import rotary_

            self.backend = TritonBackend(caches[0].device)
            self.rms_norm, self.rotary = rms_norm, rotary_
        else:
            self.backend, self.rms_norm, self.rotary = TorchReferenceBackend(), _rms_norm_torch, _rotary_torch

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m, s = self.model, self.model.shape
        batch = tokens.shape[0]
        x, residual = m.embed[tokens], None
        for layer, cache in zip(m.layers, self.caches):
            h, residual = self.rms_norm(x, layer["norm1"], s.eps, residual)
            qkv = (h @ layer["qkv"].t()).view(batch, s.heads + 2 * s.kv_heads, s.head_dim)
            self.rotary(qkv[:, : s.heads + s.kv_heads], positions, m.cos, m.sin)
            q = qkv[:, : s.heads]
            k = qkv[:, s.heads : s.heads + s.kv_heads]
            v = qkv[:, s.heads + s.kv_heads :]
            attn = self.backend.forward(q, k, v, cache, meta, s.head_dim**-0.5)
            x = attn.reshape(batch, s.heads * s.head_dim) @ layer["o"].t()
            h, residual = self.rms_norm(x, layer["norm2"], s.eps, residual)
            gate, up = (h @ layer["gate_up"].t()).chunk(2, dim=-1)
            x = (F.silu(gate) * up) @ layer["down"].t()
        h, _ = self.rms_norm(x, m.final_norm, s.eps, residual)
        return h @ m.lm_head.t()

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.logits(tokens, positions, meta).argmax(-1)


def decode_metadata(batch: int, context: int, device: torch.device) -> AttentionMetadata:
    """Every sequence at `context` positions, its last one being written this step; sequence b
    owns blocks b * W + 1 ... (block 0 unused)."""
    width = math.ceil(context / BLOCK_SIZE)
    tables = torch.arange(batch * width, dtype=torch.int64).view(batch, width) + 1
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device=device),
        query_lens=[1] * batch,
        seq_lens_list=[context] * batch,
        num_decodes=batch,
        block_size=BLOCK_SIZE,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run, device: torch.device, steps: int) -> float:
    """Median seconds of one call of `run` over `steps` timed calls (after two warm-up calls)."""
    for _ in range(2):
        run()
    _synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, size: int = 1 << 30) -> float | None:
    """Bytes per second of a device-to-device copy of `size` bytes (read + write)."""
    if device.type != "cuda":
        return None
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_steps(lambda: dst.copy_(src), device, 10)
    return 2 * size / seconds


@dataclass(slots=True)
class BatchResult:
    batch: int
    context: int
    bytes_per_step: int
    eager_ms: float
    graph_ms: float | None
    tokens_per_s: float
    hbm_fraction_nominal: float
    hbm_fraction_measured: float | None
    graph_speedup: float | None
    graph_tokens_equal_eager: bool | None


def run_batch(
    model: RandomLlama, batch: int, context: int, steps: int, hbm: float, copy_bw: float | None, graphs: bool
) -> BatchResult:
    s = model.shape
    device = model.embed.device
    width = math.ceil(context / BLOCK_SIZE)
    slots = (batch * width + 1) * BLOCK_SIZE
    caches = [
        torch.randn(slots, 2, s.kv_heads, s.head_dim, device=device, dtype=model.embed.dtype)
        for _ in range(s.layers)
    ]
    meta = decode_metadata(batch, context, device)
    step = Step(model, caches, "triton")
    step.backend.prepare(meta)
    tokens = torch.randint(0, s.vocab, (batch,), device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    eager_out = step(tokens, positions, meta)
    eager = time_steps(lambda: step(tokens, positions, meta), device, steps)
    graph_seconds, same = None, None
    if graphs and device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
            for _ in range(2):
                step(tokens, positions, meta)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = step(tokens, positions, meta)
        graph.replay()
        _synchronize(device)
        same = bool(torch.equal(graph_out, eager_out))
        graph_seconds = time_steps(graph.replay, device, steps)
    kv_bytes = batch * s.layers * 2 * s.kv_heads * s.head_dim * context * caches[0].element_size()
    total = model.matrix_bytes() + batch * s.hidden * model.embed.element_size() + kv_bytes
    best = min(eager, graph_seconds or eager)
    return BatchResult(
        batch=batch,
        context=context,
        bytes_per_step=total,
        eager_ms=eager * 1e3,
        graph_ms=None if graph_seconds is None else graph_seconds * 1e3,
        tokens_per_s=batch / best,
        hbm_fraction_nominal=total / best / hbm,
        hbm_fraction_measured=None if copy_bw is None else total / best / copy_bw,
        graph_speedup=None if graph_seconds is None else eager / graph_seconds,
        graph_tokens_equal_eager=same,
    )


def reference_check(model: RandomLlama, context: int) -> dict[str, float | bool]:
    """One step of batch 2 with the Triton kernels and with their PyTorch references, same cache."""
    s = model.shape
    device = model.embed.device
    width = math.ceil(context / BLOCK_SIZE)
    cache = [
        torch.randn(
            (2 * width + 1) * BLOCK_SIZE, 2, s.kv_heads, s.head_dim, device=device, dtype=model.embed.dtype
        )
        for _ in range(s.layers)
    ]
    tokens = torch.tensor([1, 2], device=device)
    positions = torch.full((2,), context - 1, dtype=torch.int64, device=device)
    logits = []
    for kernels in ("triton", "torch"):
        step = Step(model, [c.clone() for c in cache], kernels)
        meta = decode_metadata(2, context, device)
        step.backend.prepare(meta)
        logits.append(step.logits(tokens, positions, meta).float())
    diff = (logits[0] - logits[1]).abs().max().item()
    scale = logits[1].abs().max().item()
    return {
        "max_logit_diff": diff,
        "max_logit": scale,
        "greedy_equal": bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (a smoke test of this script)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="context length of every sequence")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="nominal HBM bandwidth, GB/s")
    parser.add_argument("--no-graphs", action="store_true", help="eager only")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shape = TINY if args.tiny else Shape()
    torch.manual_seed(0)
    model = RandomLlama(shape, device, getattr(torch, args.dtype), args.context + 1)
    copy_bw = copy_bandwidth(device)
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": args.dtype,
        "shape": asdict(shape),
        "hbm_gbps_nominal": args.hbm_gbps,
        "copy_gbps_measured": None if copy_bw is None else copy_bw / 1e9,
        "reference_check": reference_check(model, min(args.context, 64)),
        "results": [],
    }
    for batch in (int(b) for b in args.batches.split(",")):
        result = run_batch(
            model, batch, args.context, args.steps, args.hbm_gbps * 1e9, copy_bw, not args.no_graphs
        )
        report["results"].append(asdict(result))
        print(json.dumps(asdict(result)), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
