"""`deepinfer bench overhead`: the share of an engine step spent outside the model forward, at a
few batch sizes, and the most asynchronous scheduling could gain by hiding it.

Each batch of B requests decodes `--output-len` tokens after a short prompt; only steps where all
B sequences decode are counted. "forward" is the model's forward and logits (what a faster
device would shrink); the rest of the step (scheduling, input preparation, sampling
bookkeeping, outputs) is what asynchronous scheduling would move beside the forward. On a GPU
the forward runs on the device while the CPU prepares the next step; on the CPU the forward is
itself Python dispatching C++ kernels on every core. So the second pass runs the same steps
while another thread does the measured overhead's worth of pure-Python work beside each forward
(as a scheduler preparing step N+1 would). "async at best" is today's step time over that
forward's time, minus one: the most overlapping could gain (negative: it would lose).
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.config.flags import int_list_argument


class _Overlap:
    """A thread that, at the start of every forward, does `work_ms` of pure-Python work (it
    holds the GIL between bytecodes, as scheduling would), then waits for the next forward."""

    def __init__(self, work_ms: float) -> None:
        self.work_s = max(work_ms, 0.0) / 1e3
        self.started = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        table: dict[int, int] = {}
        while True:
            self.started.wait()
            self.started.clear()
            if self._stop:
                return
            end, i = time.perf_counter() + self.work_s, 0
            while time.perf_counter() < end:
                table[i % 4096] = i
                i += 1

    def __enter__(self) -> _Overlap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self.started.set()
        self._thread.join()


def _measure(llm: Any, batch: int, output_len: int, overlap: _Overlap | None = None) -> dict[str, float]:
    from deepinfer import SamplingParams

    engine, runner = llm.engine, llm.engine.core.runner
    forward_s = [0.0]
    inner = runner.forward

    def timed_forward(inputs: Any) -> Any:
        if overlap is not None:
            overlap.started.set()
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
    llm = LLM(args.model, num_threads=args.threads)
    for batch in args.batch_sizes:
        _measure(llm, batch, 4)  # warm-up
        alone = _measure(llm, batch, args.output_len)
        with _Overlap(alone["step_ms"] - alone["forward_ms"]) as overlap:
            beside = _measure(llm, batch, args.output_len, overlap)
        # With the overhead hidden, a step would take about the forward's time with the work beside it.
        bound = alone["step_ms"] / beside["forward_ms"] - 1.0 if beside["forward_ms"] else 0.0
        records.append({**alone, "forward_ms_with_overlap": beside["forward_ms"], "async_bound": bound})
        rows.append(
            [
                batch,
                f"{alone['step_ms']:.2f}",
                f"{alone['forward_ms']:.2f}",
                f"{alone['overhead_share']:.1%}",
                f"{alone['tokens_per_s']:.1f}",
                f"{beside['forward_ms']:.2f}",
                f"{bound:+.1%}",
            ]
        )
    llm.close()
    headers = ["batch", "step ms", "forward ms", "outside forward", "tok/s"]
    headers += ["forward ms, overhead beside it", "async at best"]
    print(markdown_table(headers, rows))
    if args.result_json:
        write_json(args.result_json, {"benchmark": "overhead", **provenance(), "runs": records})
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "overhead", help="share of a step outside the model forward, and what hiding it could gain"
    )
    p.add_argument(
        "--model", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--batch-sizes", type=int_list_argument, default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--result-json")
    return p
