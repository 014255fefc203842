"""`deepinfer bench overhead`: the share of an engine step spent outside the model forward, at a
few batch sizes, the most asynchronous scheduling could gain by hiding it, and what it gains.

Each batch of B requests decodes `--output-len` tokens after a short prompt; only steps where all
B sequences decode are counted. "forward" is the model's forward and logits (what a faster
device would shrink); the rest of the step (scheduling, input preparation, sampling
bookkeeping, outputs) is what asynchronous scheduling would move beside the forward. On a GPU
the forward runs on the device while the CPU prepares the next step; on the CPU the forward is
itself Python dispatching C++ kernels on every core. So the second pass runs the same steps
while another thread does the measured overhead's worth of pure-Python work beside each forward
(as a scheduler preparing step N+1 would). "async at best" is today's step time over that
forward's time, minus one: the most overlapping could gain (negative: it would lose).

The third pass runs the same requests through an engine with `async_scheduling=True` (the same
weights): its forward runs on a forward thread while the engine plans the next step and hands the
last one's tokens to the output processor. There "outside forward" is the share of the decode
window in which no forward runs (the forward thread waits for its next step), and tok/s is
measured over the same steps. The synchronous and the async passes alternate `--repeats` times;
each reports its median run (by tok/s), since one pass on a shared 2-core machine moves by tens
of percent. Every pass runs a fresh engine in a process of its own (see `_in_own_process`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
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
    # [start, end] of every forward (perf_counter; end None while it runs, on the forward thread).
    forwards: list[list[float | None]] = []
    inner = runner.forward

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        if overlap is not None:
            overlap.started.set()
        span: list[float | None] = [time.perf_counter(), None]
        forwards.append(span)
        try:
            return inner(*args, **kwargs)
        finally:
            span[1] = time.perf_counter()

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
            start = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if decoding:
                steps += 1
                step_s += end - start
                # The forward time inside this step's wall time (with async scheduling, a forward
                # runs across the steps that plan and land around it).
                forward_total += sum(max(min(b or end, end) - max(a, start), 0.0) for a, b in list(forwards))
            forwards[:] = [span for span in forwards if span[1] is None or span[1] > end]
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


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def _engine_pass(
    options: dict[str, Any], batch: int, output_len: int, overlap_ms: float | None
) -> dict[str, float]:
    """One measured pass (after a short warm-up) of a fresh engine, in the process it runs in."""
    from deepinfer import LLM

    llm = LLM(**options)
    try:
        _measure(llm, batch, 4)
        if overlap_ms is None:
            return _measure(llm, batch, output_len)
        with _Overlap(overlap_ms) as overlap:
            return _measure(llm, batch, output_len, overlap)
    finally:
        llm.close()


def _in_own_process(
    options: dict[str, Any], batch: int, output_len: int, overlap_ms: float | None = None
) -> dict:
    """_engine_pass in a new process: libgomp keeps idle workers for every thread that has led a
    parallel region and sleeps at barriers once they outnumber the cores, so a synchronous engine
    (the main thread leads) and an async one (its forward thread leads) in one process slow each
    other down."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_engine_pass, options, batch, output_len, overlap_ms).result()


def run(args: argparse.Namespace) -> int:
    rows, records = [], []
    options = {"model": args.model, "num_threads": args.threads, "kv_cache_memory": args.kv_cache_memory}
    async_options = {**options, "async_scheduling": True}
    for batch in args.batch_sizes:
        alone_runs, async_runs = [], []
        for _ in range(args.repeats):
            alone_runs.append(_in_own_process(options, batch, args.output_len))
            async_runs.append(_in_own_process(async_options, batch, args.output_len))
        alone, overlapped = _median_run(alone_runs), _median_run(async_runs)
        beside = _in_own_process(options, batch, args.output_len, alone["step_ms"] - alone["forward_ms"])
        # With the overhead hidden, a step would take about the forward's time with the work beside it.
        bound = alone["step_ms"] / beside["forward_ms"] - 1.0 if beside["forward_ms"] else 0.0
        gain = overlapped["tokens_per_s"] / alone["tokens_per_s"] - 1.0 if alone["tokens_per_s"] else 0.0
        records.append(
            {
                **alone,
                "forward_ms_with_overlap": beside["forward_ms"],
                "async_bound": bound,
                "async": overlapped,
                "async_gain": gain,
                "sync_tokens_per_s_runs": [r["tokens_per_s"] for r in alone_runs],
                "async_tokens_per_s_runs": [r["tokens_per_s"] for r in async_runs],
            }
        )
        rows.append(
            [
                batch,
                f"{alone['step_ms']:.2f}",
                f"{alone['forward_ms']:.2f}",
                f"{alone['overhead_share']:.1%}",
                f"{alone['tokens_per_s']:.1f}",
                f"{bound:+.1%}",
                f"{overlapped['step_ms']:.2f}",
                f"{overlapped['overhead_share']:.1%}",
                f"{overlapped['tokens_per_s']:.1f}",
                f"{gain:+.1%}",
            ]
        )
    headers = ["batch", "step ms", "forward ms", "outside forward", "tok/s", "async at best"]
    headers += ["async: step ms", "async: outside forward", "async: tok/s", "async gain"]
    print(markdown_table(headers, rows))
    if args.result_json:
        write_json(args.result_json, {"benchmark": "overhead", **provenance(), "runs": records})
    return 0


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "overhead",
        help="share of a step outside the model forward, what hiding it could gain, and async scheduling",
    )
    p.add_argument(
        "--model", default=None, help="a .gguf file or a HF directory (default: the embedded model)"
    )
    p.add_argument("--batch-sizes", type=int_list_argument, default=[1, 8, 32])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--repeats", type=int, default=3, help="alternating synchronous/async passes per batch size"
    )
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV cache of each engine")
    p.add_argument("--result-json")
    return p
