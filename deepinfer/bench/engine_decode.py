"""The engine's own decode step on one CUDA device, with decode CUDA graphs and without them
(--enforce-eager): milliseconds per step and the speedup, issue 33's target being graphs >= 1.5x
eager at batch 1. Run by deepinfer/bench/device_check.sh.

The step is ModelRunner.run, as the engine core calls it: rows laid out on the host, the pinned
non-blocking upload, attention metadata, LlamaForCausalLM on the Triton backend, the logits; then
the greedy token read back to the host, as sampling does. The model is Llama-shaped with random
weights (no checkpoint or tokenizer: the device machine has none), the scheduler is left out.
Both runs share the weights and start from the same cache, so their tokens are compared too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.bench.device_decode import Shape
from deepinfer.cache_layout import plan_cache_layout
from deepinfer.model.config import ModelConfig
from deepinfer.model.llama.model import LlamaForCausalLM
from deepinfer.runner.graphs import CudaGraphCapture, default_sizes
from deepinfer.runner.inputs import ForwardWork, RowSpan
from deepinfer.runner.kv_caches import KVCaches
from deepinfer.runner.model_runner import ModelRunner

BLOCK_SIZE = 16
# A Llama-3.2-1B shape: at batch 1 its step is short enough that launching it is what costs.
SMALL = Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256)
SHAPES = {"1b": SMALL, "8b": Shape(), "tiny": Shape(64, 2, 4, 2, 16, 96, 300)}


def random_llama(
    shape: Shape, device: torch.device, dtype: torch.dtype, max_positions: int
) -> LlamaForCausalLM:
    cfg = ModelConfig(
        model_type="llama", vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_layers=shape.layers, num_heads=shape.heads,
        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.eps,
        rope_theta=shape.rope_theta, max_position_embeddings=max_positions,
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02) if param.dim() == 2 else param.fill_(1.0)
    return model.eval()


def make_runner(
    model: LlamaForCausalLM, batch: int, context: int, graphs: bool, seed: int
) -> tuple[ModelRunner, list[list[int]]]:
    """A runner over a cache of `batch` sequences of `context` positions (random K/V drawn from
    `seed`), and each sequence's block table."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    groups = model.cache_groups(dtype)
    width = math.ceil((context + 64) / BLOCK_SIZE)
    layout = plan_cache_layout(groups, BLOCK_SIZE, num_blocks=batch * width, max_num_seqs=batch)
    caches = KVCaches(layout, {"target": groups}, device, scratch_block=graphs)
    generator = torch.Generator(device).manual_seed(seed)
    for group, tensors in zip(layout.groups, caches.tensors):
        for tensor in tensors:  # the scratch block past the slots left out: both runs draw alike
            tensor[: group.num_slots].normal_(0.0, 1.0, generator=generator)
    runner = ModelRunner(model, caches, device, "triton")
    capture = CudaGraphCapture(device)
    if graphs and not runner.use_decode_graphs(capture, default_sizes(batch), context + 64):
        raise RuntimeError("the runner refused decode graphs")
    return runner, [list(range(b * width, (b + 1) * width)) for b in range(batch)]


def decode(runner: ModelRunner, tables: list[list[int]], tokens: list[int], position: int) -> list[int]:
    """One step of every sequence at `position`; the greedy tokens, on the host."""
    spans = [RowSpan([table], position, [token]) for table, token in zip(tables, tokens)]
    _, _, logits = runner.run(ForwardWork(spans, [], list(range(len(spans)))))
    assert logits is not None
    return logits.argmax(-1).tolist()


@dataclass(slots=True)
class Timing:
    graphs: bool
    ms_per_step: float
    tokens: list[list[int]]  # the greedy tokens of the first steps


def time_decode(model: LlamaForCausalLM, batch: int, context: int, steps: int, graphs: bool) -> Timing:
    runner, tables = make_runner(model, batch, context, graphs, seed=1)
    tokens = [1 + b for b in range(batch)]
    seen: list[list[int]] = []
    times = []
    for step in range(steps + 3):  # the first steps compile (and capture) and are not timed
        start = time.perf_counter()
        tokens = decode(runner, tables, tokens, context + step)
        times.append(time.perf_counter() - start)
        seen.append(tokens)
    return Timing(graphs, statistics.median(times[3:]) * 1e3, seen[:4])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="positions already in every sequence")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = random_llama(
        SHAPES[args.shape], device, getattr(torch, args.dtype), args.context + args.steps + 128
    )
    report: dict = {"shape": args.shape, "dtype": args.dtype, "context": args.context, "results": []}
    for batch in (int(b) for b in args.batches.split(",")):
        eager = time_decode(model, batch, args.context, args.steps, graphs=False)
        graphed = time_decode(model, batch, args.context, args.steps, graphs=True)
        result = {
            "batch": batch,
            "eager_ms": eager.ms_per_step,
            "graph_ms": graphed.ms_per_step,
            "graph_speedup": eager.ms_per_step / graphed.ms_per_step,
            "tokens_equal": eager.tokens == graphed.tokens,
            "first_tokens": [eager.tokens[0], graphed.tokens[0]],
        }
        report["results"].append(result)
        print(json.dumps(result), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
