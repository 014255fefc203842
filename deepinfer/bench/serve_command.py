"""`bench serve` end to end: build the dataset, warm up, run each load level, report."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deepinfer.bench.client import RequestSettings, endpoint_url
from deepinfer.bench.datasets import BenchRequest, build_dataset
from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.bench.serve import (
    LoadConfig,
    RunOutcome,
    discover_model,
    load_config_dict,
    run_load,
    summarize_run,
    warm_up,
)
from deepinfer.bench.stats import Slo


@dataclass(slots=True)
class ServeOptions:
    base_url: str
    api: str = "chat"
    model: str | None = None
    endpoint: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    num_prompts: int = 100
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0
    agent_turns: int = 4
    agent_user_len: int = 64
    agent_context_len: int = 0
    seed: int = 0
    max_concurrency: int | None = None
    request_rate: float = math.inf
    think_time_s: float = 0.0
    sweep_concurrency: list[int] = field(default_factory=list)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2e_ms: float | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    warmup: bool = True
    timeout_s: float = 600.0
    num_cards: int = 1
    result_json: str | None = None
    plot_dir: str | None = None
    save_detailed: bool = False
    show_progress: bool = True


def _slo(options: ServeOptions) -> Slo:
    def seconds(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return Slo(seconds(options.slo_ttft_ms), seconds(options.slo_tpot_ms), seconds(options.slo_e2e_ms))


def _warmup_request(options: ServeOptions) -> BenchRequest:
    """A short prompt unlike the dataset's, so it seeds no prefix cache the run measures."""
    return BenchRequest(
        request_id="warmup",
        session_id=-1,
        turn=0,
        system=None,
        messages=[{"role": "user", "content": "Warm-up: say hello."}],
        output_len=min(options.output_len or 16, 16),
        approx_input_tokens=4,
    )


def run_serve(options: ServeOptions, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (one load level, or one per swept concurrency) and return the result."""
    if options.num_cards < 1:
        raise ValueError(f"num_cards must be >= 1, got {options.num_cards}")
    model = options.model or asyncio.run(discover_model(options.base_url, options.api_key))
    settings = RequestSettings(
        api=options.api,
        url=endpoint_url(options.base_url, options.api, options.endpoint),
        model=model,
        api_key=options.api_key,
        ignore_eos=options.ignore_eos,
        temperature=options.temperature,
        extra_body=dict(options.extra_body),
    )
    dataset = build_dataset(
        options.dataset,
        options.num_prompts,
        options.seed,
        options.input_len,
        options.output_len,
        options.range_ratio,
        options.agent_turns,
        options.agent_user_len,
        options.agent_context_len,
    )
    base_load = LoadConfig(
        max_concurrency=options.max_concurrency,
        request_rate=options.request_rate,
        think_time_s=options.think_time_s,
        seed=options.seed,
        timeout_s=options.timeout_s,
        show_progress=options.show_progress,
    )
    loads = [replace(base_load, max_concurrency=c) for c in options.sweep_concurrency] or [base_load]
    if options.warmup:
        asyncio.run(warm_up(settings, _warmup_request(options), options.timeout_s))

    slo = _slo(options)
    outcomes: list[RunOutcome] = []
    runs: list[dict[str, Any]] = []
    for load in loads:
        outcome = asyncio.run(run_load(settings, dataset, load))
        outcomes.append(outcome)
        runs.append(
            {
                "load": load_config_dict(load),
                "summary": summarize_run(outcome, slo, options.num_cards),
                "requests": [r.to_dict(options.save_detailed) for r in outcome.results],
            }
        )

    options_record = asdict(options)
    options_record["request_rate"] = None if math.isinf(options.request_rate) else options.request_rate
    options_record.pop("api_key")
    result: dict[str, Any] = {
        "benchmark": "serve",
        **provenance(argv),
        "config": {**options_record, "model": model, "url": settings.url, "dataset_size": len(dataset)},
        "runs": runs,
    }
    if options.plot_dir:
        result["plots"] = _write_plots(options.plot_dir, outcomes, [run["summary"] for run in runs])
    if options.result_json:
        write_json(options.result_json, result)
    return result


def _write_plots(plot_dir: str, outcomes: list[RunOutcome], summaries: list[dict[str, Any]]) -> list[str]:
    from deepinfer.bench.plots import plot_concurrency_sweep, plot_latency_cdfs  # matplotlib: only when asked

    paths = [plot_latency_cdfs(outcomes, Path(plot_dir) / "latency_cdf.png")]
    if len(summaries) > 1:
        paths.append(plot_concurrency_sweep(summaries, Path(plot_dir) / "throughput_vs_concurrency.png"))
    return [str(p) for p in paths]


def format_serve_summary(result: dict[str, Any]) -> str:
    """A markdown table with one row per load level, for the terminal and for docs."""
    headers = [
        "concurrency",
        "rate",
        "ok/failed",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "ITL p50 ms",
        "goodput req/s",
        "cache hit",
    ]
    rows = []
    for run in result["runs"]:
        s = run["summary"]
        hit = s["prefix_cache_hit_rate"]
        rows.append(
            [
                s["max_concurrency"] if s["max_concurrency"] is not None else "∞",
                s["request_rate"] if s["request_rate"] is not None else "∞",
                f"{s['completed']}/{s['failed']}",
                s["request_throughput"],
                s["output_throughput"],
                (s["ttft_ms"] or {}).get("p50"),
                (s["ttft_ms"] or {}).get("p99"),
                (s["tpot_ms"] or {}).get("p50"),
                (s["tpot_ms"] or {}).get("p99"),
                (s["itl_ms"] or {}).get("p50"),
                s["goodput"],
                f"{hit:.1%}" if hit is not None else "not reported",
            ]
        )
    return markdown_table(headers, rows)
