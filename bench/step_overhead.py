"""`deepinfer bench overhead`: the share of an engine step spent outside the model forward, at a
few batch sizes, with asynchronous scheduling off and on.

Each batch of B requests decodes `--output-len` tokens after a short prompt; only steps where all
B sequences decode are counted. "forward" is the model's forward and logits (what a faster
device would shrink); the rest of the step (scheduling, input preparation, sampling
bookkeeping, outputs) is the overhead asynchronous scheduling hides behind the forward.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.config.flags import int_list_argument


def _measure(llm: Any, batch: int, output_len: int) -> dict[str, float]:
    from deepinfer import SamplingParams

    engine, runner = llm.engine, llm.engine.core.runner
    forward_s = [0.0]
    inner = runner.forward

    def timed_forward(inputs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(inputs)
        finally:
            forward_s[0] += time.perf_counter() - start

    runner.forward = timed_forward
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], params)
    steps, step_s, forward_total = 0, 0.0, 0.0
    try:
        while engine.has_unfinished_requests():
            decoding = len(engine.core.scheduler.running) == batch and all(
                s.num_output_tokens > 0 for s in engine.core.scheduler.running
            )
            forward_s[0] = 0.0
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if decoding:
                steps += 1
                step_s += elapsed
                forward_total += forward_s[0]
    finally:
        runner.forward = inner
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": 1e3 * step_s / max(steps, 1),
        "forward_ms": 1e3 * forward_total / max(steps, 1),
        "overhead_share": 1.0 - forward_total / step_s if step_s else 0.0,
        "tokens_per_s": batch * steps / step_s if step_s else 0.0,
    }


def run(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    rows, records = [], []
    for mode in args.modes:
        llm = LLM(
            args.model, num_threads=args.threads, **({"async_scheduling": True} if mode == "on" else {})
        )
        for batch in args.batch_sizes:
            _measure(llm, batch, 4)  # warm-up
            record = {"async_scheduling": mode, **_measure(llm, batch, args.output_len)}
            records.append(record)
            rows.append(
                [
                    mode,
                    batch,
                    f"{record['step_ms']:.2f}",
                    f"{record['forward_ms']:.2f}",
                    f"{record['overhead_share']:.1%}",
                    f"{record['tokens_per_s']:.1f}",
                ]
            )
        llm.close()
    print(markdown_table(["async", "batch", "step ms", "forward ms", "outside forward", "tok/s"], rows))
    if args.result_json:
        write_json(args.result_json, {"benchmark": "overhead", **provenance(), "runs": records})
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "overhead", help="share of a step outside the model forward, async scheduling off/on"
    )
    p.add_argument(
        "--model", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--batch-sizes", type=int_list_argument, default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", type=lambda s: s.split(","), default=["off", "on"], help="off,on")
    p.add_argument("--result-json")
    return p
