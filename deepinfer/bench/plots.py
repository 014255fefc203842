"""PNG plots of benchmark results (matplotlib, headless): latency CDFs and concurrency sweeps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.bench.serve import BenchError, RunOutcome


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise BenchError(
            "plots need matplotlib: pip install 'deepinfer[bench]' (or drop --plot-dir)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(outcome: RunOutcome) -> str:
    if outcome.max_concurrency is not None:
        return f"concurrency {outcome.max_concurrency}"
    return f"rate {outcome.request_rate:g}/s"


def plot_latency_cdfs(outcomes: Sequence[RunOutcome], path: str | Path) -> Path:
    """One panel per latency metric (TTFT, TPOT, ITL, E2E), one CDF line per load level."""
    plt = _pyplot()
    metrics = (
        ("TTFT", lambda r: [r.ttft_s] if r.ttft_s is not None else []),
        ("TPOT", lambda r: [r.tpot_s] if r.tpot_s is not None else []),
        ("ITL", lambda r: r.itl_s),
        ("E2E latency", lambda r: [r.e2e_s] if r.e2e_s is not None else []),
    )
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (title, pick) in zip(axes.flat, metrics):
        for outcome in outcomes:
            values = sorted(v * 1000.0 for r in outcome.results if r.success for v in pick(r))
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axis.step(values, fractions, where="post", label=_label(outcome))
        low, high = axis.dataLim.intervalx
        if axis.has_data() and low > 0 and high / low >= 100:
            axis.set_xscale("log")  # tails span decades; a linear axis would squash the body
        axis.set_title(title)
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of samples ≤ x")
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize="small")
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def plot_concurrency_sweep(summaries: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Output throughput, and median TTFT/TPOT, against the concurrency cap."""
    plt = _pyplot()
    points = sorted(
        (s for s in summaries if s["max_concurrency"] is not None), key=lambda s: s["max_concurrency"]
    )
    levels = [s["max_concurrency"] for s in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(levels, [s["output_throughput"] for s in points], marker="o")
    left.set_title("Output throughput")
    left.set_xlabel("max concurrency")
    left.set_ylabel("tokens/s")
    for key, name in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50")):
        right.plot(levels, [(s[key] or {}).get("p50") for s in points], marker="o", label=name)
    right.set_title("Median latency")
    right.set_xlabel("max concurrency")
    right.set_ylabel("ms")
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target
