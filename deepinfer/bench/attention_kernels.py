"""Micro-benchmark of the CPU attention paths, per layer of the default model's shape.

    .venv/bin/python -m deepinfer.bench.attention_kernels

- decode: the C kernel over a paged cache (fp32 and fp16 K/V), batch x context, blocks scattered
  as in a long-running engine;
- bandwidth: one decode step of the 32-stream peers workload (32 rows x ~400 tokens, fp16 K/V)
  through 30 layers' caches in turn (as the engine reads them: 300 MB, past the last-level cache),
  as GB/s of K/V read; the thread CPU time per layer is also given (a figure on a loaded machine);
- chunk rows: a prompt chunk after a cached prefix through the C kernel, every row a kernel row
  (the default model's prefill path), fp16 K/V: a KV-store hit's 427 new rows after 3,328
  positions and an 8k prompt's last 1,024-row chunk;
- prefill: one causal chunk, PyTorch's SDPA (the reference backend) vs the tiled GEMMs the CPU
  backend uses.
Times are the mean of repeated calls after a warm-up; 2 threads unless DEEPINFER_BENCH_THREADS.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from functools import partial

import torch

from deepinfer.attention.backend import attend_sequence
from deepinfer.attention.cpu_paged import CpuPagedBackend
from deepinfer.attention.metadata import AttentionMetadata
from deepinfer.attention.prefill_tiled import attend_chunk_tiled

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def _mean_ms(action: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        action()
    start = time.perf_counter()
    for _ in range(repeats):
        action()
    return (time.perf_counter() - start) / repeats * 1e3


def _decode_step(batch: int, context: int) -> tuple[AttentionMetadata, int]:
    per_seq = -(-context // BLOCK)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    slots = [t[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables),
        seq_lens=torch.full((batch,), context),
        query_lens=[1] * batch,
        seq_lens_list=[context] * batch,
        num_decodes=batch,
        block_size=BLOCK,
    )
    return meta, len(blocks)


def decode(backend: CpuPagedBackend) -> None:
    print("decode, C kernel: ms per layer (x30 layers per step)")
    for batch, context in ((1, 640), (16, 320), (64, 320), (64, 640)):
        meta, num_blocks = _decode_step(batch, context)
        backend.prepare(meta)
        q = torch.randn(batch, HEADS, HEAD_DIM)
        k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
        times = {}
        for dtype in (torch.float32, torch.float16):
            cache = torch.randn(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM).to(dtype)
            times[dtype] = _mean_ms(partial(backend.forward, q, k, v, cache, meta, HEAD_DIM**-0.5), 30)
        fp32, fp16 = times[torch.float32], times[torch.float16]
        print(
            f"  batch {batch:3d} x {context} tokens: fp32 {fp32:.3f}  fp16 {fp16:.3f}  ({fp32 / fp16:.2f}x)"
        )


def bandwidth(backend: CpuPagedBackend, batch: int = 32, context: int = 400, layers: int = 30) -> None:
    print(f"decode step, fp16 K/V: {batch} rows x {context} tokens x {layers} layers")
    meta, num_blocks = _decode_step(batch, context)
    backend.prepare(meta)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty_like(q)
    caches = [torch.randn(num_blocks * BLOCK, 2, KV_HEADS, HEAD_DIM).half() for _ in range(layers)]
    tables, lens = meta.extra["kernel_tables"], meta.extra["kernel_lens"]

    def step() -> None:
        for cache in caches:
            backend.attend_rows(q, cache, out, tables, lens, BLOCK, HEAD_DIM**-0.5)

    step()
    repeats = 10
    wall, cpu = time.perf_counter(), time.process_time()  # process time: every thread's
    for _ in range(repeats):
        step()
    wall, cpu = (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats
    read = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 * layers  # K and V, bytes
    print(
        f"  {wall * 1e3 / layers:.3f} ms per layer, {read / wall / 1e9:.1f} GB/s; "
        f"CPU time {cpu * 1e3 / layers:.3f} ms per layer"
    )


def chunk_rows(backend: CpuPagedBackend) -> None:
    print("chunk after a cached prefix, C kernel rows, fp16 K/V: ms per layer")
    for rows, prefix in ((427, 3328), (1024, 7000)):
        per_seq = -(-(prefix + rows) // BLOCK)
        blocks = list(range(per_seq))
        random.Random(0).shuffle(blocks)  # scattered, as in a long-running engine
        tables = torch.tensor([blocks] * rows)
        lens = torch.arange(prefix + 1, prefix + rows + 1)  # row r attends to positions 0 .. prefix + r
        cache = torch.randn(per_seq * BLOCK, 2, KV_HEADS, HEAD_DIM).half()
        q = torch.randn(rows, HEADS, HEAD_DIM)
        out = torch.empty_like(q)
        call = partial(backend.attend_rows, q, cache, out, tables, lens, BLOCK, HEAD_DIM**-0.5)
        print(f"  {rows} rows after {prefix} positions: {_mean_ms(call, 5):.1f}")


def prefill() -> None:
    print("prefill chunk, causal: ms per layer")
    for chunk, context in ((512, 512), (2048, 2048), (1952, 4000)):
        q = torch.randn(chunk, HEADS, HEAD_DIM)
        keys, values = torch.randn(context, KV_HEADS, HEAD_DIM), torch.randn(context, KV_HEADS, HEAD_DIM)
        sdpa = _mean_ms(partial(attend_sequence, q, keys, values, HEAD_DIM**-0.5), 3)
        tiled = _mean_ms(partial(attend_chunk_tiled, q, keys, values, HEAD_DIM**-0.5), 3)
        print(f"  {chunk} queries over {context}: SDPA {sdpa:.1f}  tiled {tiled:.1f}  ({sdpa / tiled:.2f}x)")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("DEEPINFER_BENCH_THREADS", "2")))
    backend = CpuPagedBackend()
    decode(backend)
    bandwidth(backend)
    chunk_rows(backend)
    prefill()
