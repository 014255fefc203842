"""`deepinfer bench prefill`: cold prefill throughput at growing prompt lengths, and the attention's share.

Each length is one cold prompt (max_tokens=1, a fresh cache salt: no prefix hit), timed to its
first token. The attention's share is measured apart: the paged attention kernel alone, on a
cache of the model's shape, over the same chunks the scheduler cuts (each chunk's rows attending
to everything before them, every layer), so the rest of the TTFT is the GEMMs, norms, rotary and
the step's overhead.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from deepinfer.bench.offline import add_common_arguments, engine_options, random_prompts
from deepinfer.bench.prefix_cache import ttft
from deepinfer.bench.report import markdown_table, provenance, write_json


def attention_seconds(engine: Any, length: int, chunk: int) -> float:
    """The paged attention of a cold `length`-token prefill in chunks of `chunk` rows, all layers,
    on random K/V and queries of the model's shape and the engine's KV dtype (the kernel's cost
    depends only on those: a bf16 cache may run on AMX tiles)."""
    import torch

    from deepinfer.attention.cpu_paged import CpuPagedBackend
    from deepinfer.attention.float32_boundary import Float32Boundary

    runner = engine.core.runner
    backend = runner.backend.inner if isinstance(runner.backend, Float32Boundary) else runner.backend
    [kv_dtype] = {t.dtype for g in engine.core.layout.groups for t in g.group.tensors}
    if not isinstance(backend, CpuPagedBackend):
        return float("nan")
    num_heads, num_kv_heads, head_dim = runner.model.attention_shape()
    layers = runner.model.config.num_layers
    block_size = engine.core.config.cache.block_size
    blocks = -(-length // block_size)
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(blocks * block_size, 2, num_kv_heads, head_dim, generator=generator).to(
        getattr(torch, kv_dtype)
    )
    table = torch.randperm(blocks, generator=generator)  # scattered blocks, as a pool hands them out
    seconds = 0.0
    for start in range(0, length, chunk):
        rows = min(chunk, length - start)
        q = torch.randn(rows, num_heads, head_dim, generator=generator)
        tables = table.repeat(rows, 1)
        lens = torch.arange(start + 1, start + rows + 1, dtype=torch.int64)
        out = torch.empty_like(q)
        began = time.perf_counter()
        for _ in range(layers):
            backend.attend_rows(q, cache, out, tables, lens, block_size, head_dim**-0.5)
        seconds += time.perf_counter() - began
    return seconds


def run(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    options = engine_options(args)
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.rope_scaling:
        options["rope_scaling"] = json.loads(args.rope_scaling)
    llm = LLM(args.model, **options)
    tokenizer = llm.get_tokenizer()
    chunk = llm.engine.core.config.scheduler.max_num_batched_tokens
    ttft(llm.engine, random_prompts(tokenizer, 1, 64, 64, args.seed)[0], cache_salt="warm-up")
    rows, results = [], []
    for length in args.lengths:
        [prompt] = random_prompts(tokenizer, 1, length, length, args.seed + length)
        cpu = time.process_time()
        seconds = ttft(llm.engine, prompt, cache_salt=f"cold-{length}")
        cpu = time.process_time() - cpu
        attention = attention_seconds(llm.engine, length, chunk)
        results.append(
            {
                "prompt_tokens": length,
                "ttft_s": seconds,
                "cpu_s": cpu,
                "tok_s": length / seconds,
                "attention_s": attention,
            }
        )
        rows.append(
            [
                str(length),
                f"{seconds:.2f} s",
                f"{cpu:.2f} s",
                f"{length / seconds:.0f}",
                f"{attention:.2f} s ({attention / seconds:.0%})",
            ]
        )
    llm.close()
    # CPU seconds beside the wall clock: on a shared machine they move less with the neighbours.
    headers = ["prompt tokens", "TTFT (cold)", "process CPU", "prefill tok/s", "attention alone"]
    print(markdown_table(headers, rows))
    if args.result_json:
        write_json(
            args.result_json, {"benchmark": "prefill", **provenance(), "chunk": chunk, "results": results}
        )
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("prefill", help="cold prefill tok/s at growing prompt lengths, attention's share")
    add_common_arguments(p)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--max-model-len", type=int, help="past the model's context: with --rope-scaling")
    p.add_argument("--rope-scaling", help='JSON, e.g. {"rope_type":"yarn","factor":4.0,...} (see README)')
    return p
