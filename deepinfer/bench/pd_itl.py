"""`deepinfer bench pd`: inter-token latency of running streams while long prompts arrive, with
prefill/decode disaggregation (1 prefill + 1 decode engine) against two co-located replicas,
both behind the router, each engine one thread, on the same machine, in one invocation.

The load: `--streams` clients each sending short chat requests that generate `--decode-len`
tokens, one after another, and `--long-clients` clients each sending `--long-len`-word prompts
(distinct, so no prefix is shared) that generate `--long-output` tokens, for `--duration`
seconds (requests in flight then finish and count). Reported: the streams' inter-token latency
(p50, p99, max) per gap, as `bench serve` counts it; the same p99 weighted by time (a stall
counts for as long as it lasted: per gap, a stream stalled for a minute adds one gap while the
streams elsewhere add thousands); the p99 over stream requests of their mean gap (TPOT); the
share of the streams' inter-token time spent in gaps of at least `--stall-s`; their TTFT, the
long prompts' TTFT, and the total throughput (prompt and output tokens of every finished request
per second). The result JSON holds every request's start, TTFT and gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from deepinfer.bench.client import RequestResult, RequestSettings, endpoint_url, send_request
from deepinfer.bench.cluster import Child, replica, router, running
from deepinfer.bench.datasets import BenchRequest, random_dataset
from deepinfer.bench.report import markdown_table, provenance, write_json
from deepinfer.bench.stats import summarize, time_weighted_percentile

MODEL = "SmolLM2-135M-Instruct"


def _short(index: int, output_len: int) -> BenchRequest:
    text = f"Stream {index}: tell a story about a lighthouse keeper."
    messages = [{"role": "user", "content": text}]
    return BenchRequest(f"stream-{index}", index, 0, None, messages, output_len, len(text.split()))


async def _load(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], list[RequestResult], float]:
    settings = RequestSettings(api="chat", url=endpoint_url(url, "chat"), model=MODEL, ignore_eos=True)
    longs = random_dataset(10_000, args.long_len, args.long_output, args.seed).requests
    streams: list[RequestResult] = []
    long_results: list[RequestResult] = []
    counter = iter(range(1_000_000))
    limits = httpx.Limits(max_connections=args.streams + args.long_clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        await send_request(client, settings, _short(-1, 4), time.perf_counter())  # warm-up
        start = time.perf_counter()
        end = start + args.duration

        async def stream_client() -> None:
            while time.perf_counter() < end:
                streams.append(
                    await send_request(client, settings, _short(next(counter), args.decode_len), start)
                )

        async def long_client(first: int) -> None:
            await asyncio.sleep(args.long_delay)  # the streams are running when the first one lands
            position = first
            while time.perf_counter() < end:
                long_results.append(await send_request(client, settings, longs[position], start))
                position += args.long_clients

        await asyncio.gather(
            *(stream_client() for _ in range(args.streams)),
            *(long_client(i) for i in range(args.long_clients)),
        )
        duration = time.perf_counter() - start
    return streams, long_results, duration


def _summary(
    name: str, streams: list[RequestResult], longs: list[RequestResult], duration: float, stall_s: float
) -> dict[str, Any]:
    ok = [r for r in streams + longs if r.success]
    tokens = sum((r.prompt_tokens or 0) + r.output_tokens for r in ok)
    gaps = [gap for r in streams if r.success for gap in r.itl_s]
    itl = summarize(gaps)
    tpot = summarize(r.tpot_s for r in streams if r.tpot_s is not None)
    stalled = sum(gap for gap in gaps if gap >= stall_s) / sum(gaps) if gaps else None
    stream_ttft = summarize(r.ttft_s for r in streams if r.success and r.ttft_s is not None)
    long_ttft = summarize(r.ttft_s for r in longs if r.success and r.ttft_s is not None)

    def ms(summary: Any, key: str) -> float | None:
        return None if summary is None else summary.to_dict()[key] * 1000.0

    return {
        "setup": name,
        "streams_ok": sum(r.success for r in streams),
        "longs_ok": sum(r.success for r in longs),
        "failed": sum(not r.success for r in streams + longs),
        "errors": sorted({r.error or "" for r in streams + longs if not r.success})[:5],
        "itl_p50_ms": ms(itl, "p50"),
        "itl_p99_ms": ms(itl, "p99"),
        "itl_max_ms": ms(itl, "max"),
        "itl_p99_time_weighted_ms": time_weighted_percentile(gaps, 99.0) * 1000.0 if gaps else None,
        "tpot_p99_ms": ms(tpot, "p99"),
        "stalled_share": stalled,
        "stream_ttft_p50_ms": ms(stream_ttft, "p50"),
        "long_ttft_p50_ms": ms(long_ttft, "p50"),
        "duration_s": duration,
        "total_tokens_per_s": tokens / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "load_average_before": os.getloadavg(),
        "requests": [
            {**r.to_dict(include_itl=True), "kind": kind}
            for kind, group in (("stream", streams), ("long", longs))
            for r in group
        ],
    }


def _measure(
    name: str,
    key: str,
    engines: list[Child],
    router_args: Callable[[list[Child]], list[str]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    with running(engines):
        load_before = os.getloadavg()
        with running([router(f"router-{key}", *router_args(engines))]) as (front,):
            streams, longs, duration = asyncio.run(_load(front.url, args))
    summary = _summary(name, streams, longs, duration, args.stall_s)
    summary["load_average_before"] = load_before
    return summary


def run(args: argparse.Namespace) -> int:
    memory = args.kv_cache_memory
    chunking = ("--prefill-chunk-size", str(args.prefill_chunk_size)) if args.prefill_chunk_size else ()
    results = [
        _measure(
            "prefill/decode (1 + 1)",
            "pd",
            [
                replica("prefill", "--role", "prefill", *chunking, kv_cache_memory=memory),
                replica("decode", "--role", "decode", *chunking, kv_cache_memory=memory),
            ],
            lambda e: ["--prefill", e[0].url, "--decode", e[1].url],
            args,
        ),
        _measure(
            "co-located (2 x both)",
            "colocated",
            [
                replica("both0", *chunking, kv_cache_memory=memory),
                replica("both1", *chunking, kv_cache_memory=memory),
            ],
            lambda e: ["--replica", e[0].url, "--replica", e[1].url, "--policy", "least_load"],
            args,
        ),
    ]
    headers = [
        "setup",
        "streams/longs ok",
        "failed",
        "ITL p50 ms",
        "ITL p99 ms",
        "ITL max ms",
        "ITL p99 time-weighted ms",
        "TPOT p99 ms",
        f"time in gaps >= {args.stall_s:g} s",
        "stream TTFT p50 ms",
        "long TTFT p50 ms",
        "total tok/s",
        "load avg before",
    ]
    rows = [
        [
            r["setup"],
            f"{r['streams_ok']}/{r['longs_ok']}",
            r["failed"],
            f"{r['itl_p50_ms']:.0f}",
            f"{r['itl_p99_ms']:.0f}",
            f"{r['itl_max_ms']:.0f}",
            f"{r['itl_p99_time_weighted_ms']:.0f}",
            f"{r['tpot_p99_ms']:.0f}",
            f"{r['stalled_share']:.1%}",
            f"{r['stream_ttft_p50_ms']:.0f}",
            f"{r['long_ttft_p50_ms']:.0f}" if r["long_ttft_p50_ms"] is not None else "n/a",
            f"{r['total_tokens_per_s']:.0f}",
            " ".join(f"{x:.1f}" for x in r["load_average_before"]),
        ]
        for r in results
    ]
    print(markdown_table(headers, rows))
    pd, colocated = results
    print(
        f"\nco-located / PD: ITL p99 {colocated['itl_p99_ms'] / pd['itl_p99_ms']:.2f}x, "
        f"time-weighted {colocated['itl_p99_time_weighted_ms'] / pd['itl_p99_time_weighted_ms']:.2f}x, "
        f"TPOT p99 {colocated['tpot_p99_ms'] / pd['tpot_p99_ms']:.2f}x; "
        f"total throughput PD / co-located = {pd['total_tokens_per_s'] / colocated['total_tokens_per_s']:.2f}"
    )
    if args.result_json:
        options = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | type(None))}
        write_json(
            args.result_json, {"benchmark": "pd", **provenance(), "options": options, "results": results}
        )
    return 0 if all(r["failed"] == 0 for r in results) else 1


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("pd", help="decode ITL under long prompts: prefill/decode vs co-located replicas")
    p.add_argument("--streams", type=int, default=4, help="clients generating all the time")
    p.add_argument("--decode-len", type=int, default=128, help="tokens each stream request generates")
    p.add_argument("--long-clients", type=int, default=1, help="clients sending long prompts back to back")
    p.add_argument("--long-len", type=int, default=4000, help="words (about tokens) per long prompt")
    p.add_argument("--long-output", type=int, default=4, help="tokens each long prompt generates")
    p.add_argument("--long-delay", type=float, default=5.0, help="seconds before the first long prompt")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per setup")
    p.add_argument(
        "--stall-s", type=float, default=1.0, help="a stream gap at least this long counts as a stall"
    )
    p.add_argument(
        "--prefill-chunk-size",
        type=int,
        help="every engine's --prefill-chunk-size (default: the engine's, a step's whole token budget)",
    )
    p.add_argument("--kv-cache-memory", default="512MiB", help="per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the full result here")
    return p
