"""`bench serve`: an asyncio load generator against any OpenAI/Anthropic-compatible server.

Arrivals follow a Poisson process at ``request_rate`` (all at once when it is infinite) and at
most ``max_concurrency`` requests are in flight. For multi-turn datasets the rate applies to
session starts; each later turn is sent when the session's previous turn has finished and its
think time has passed (none by default).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from deepinfer.bench.client import RequestResult, RequestSettings, send_request
from deepinfer.bench.datasets import BenchRequest, Dataset
from deepinfer.bench.stats import Slo, count_good, summarize


class BenchError(Exception):
    """A benchmark that cannot run (unreachable server, failed warm-up); the message says why."""


@dataclass(slots=True)
class LoadConfig:
    """How hard to push: concurrency cap, arrival rate (inf = all requests at time zero) and, for
    multi-turn sessions, the pause between a turn's answer and the next turn (an agent running
    its tools, a user reading)."""

    max_concurrency: int | None = None
    request_rate: float = math.inf
    think_time_s: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0 <= self.think_time_s < math.inf:
            raise ValueError(f"think_time_s must be >= 0 and finite, got {self.think_time_s}")


@dataclass(slots=True)
class RunOutcome:
    """Everything one load level measured."""

    max_concurrency: int | None
    request_rate: float
    duration_s: float
    results: list[RequestResult] = field(default_factory=list)


def session_start_times(count: int, request_rate: float, seed: int) -> list[float]:
    """Offsets (s) at which sessions start: exponential gaps for a Poisson process at the rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    starts, now = [], 0.0
    for _ in range(count):
        starts.append(now)
        now += rng.expovariate(request_rate)
    return starts


async def run_load(settings: RequestSettings, dataset: Dataset, load: LoadConfig) -> RunOutcome:
    """Send every request of the dataset under the load settings and time each one."""
    semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    limits = httpx.Limits(max_connections=load.max_concurrency or len(dataset) or 1)
    timeout = httpx.Timeout(load.timeout_s, connect=30.0)
    results: list[RequestResult] = []
    progress = tqdm(total=len(dataset), disable=not load.show_progress, desc="requests")

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        run_start = time.perf_counter()

        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send_request(client, settings, request, run_start)
            async with semaphore:
                return await send_request(client, settings, request, run_start)

        async def session(requests: list[BenchRequest], start_offset: float) -> None:
            delay = run_start + start_offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for turn, request in enumerate(requests):
                if turn and load.think_time_s:
                    await asyncio.sleep(load.think_time_s)
                results.append(await one(request))
                progress.update(1)

        starts = session_start_times(len(dataset.sessions), load.request_rate, load.seed)
        await asyncio.gather(*(session(s, t) for s, t in zip(dataset.sessions, starts)))
        duration = time.perf_counter() - run_start
    progress.close()
    return RunOutcome(load.max_concurrency, load.request_rate, duration, results)


async def warm_up(settings: RequestSettings, request: BenchRequest, timeout_s: float) -> None:
    """One request before timing starts: proves the endpoint works and loads lazy state."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        result = await send_request(client, settings, request, time.perf_counter())
    if not result.success:
        raise BenchError(f"warm-up request to {settings.url} failed: {result.error}")


async def discover_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model id from GET /v1/models, for servers that serve one model."""
    url = base_url.rstrip("/")
    url = url + ("/models" if url.endswith("/v1") else "/v1/models")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url, headers=headers)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"could not read the model name from {url} ({exc}); pass --model") from exc


def _ms(summary: Any) -> dict[str, float | int] | None:
    """A Summary of seconds as a dict of milliseconds (count stays a count)."""
    if summary is None:
        return None
    return {k: (v if k == "count" else v * 1000.0) for k, v in summary.to_dict().items()}


def summarize_run(outcome: RunOutcome, slo: Slo, num_cards: int = 1) -> dict[str, Any]:
    """The headline numbers of one load level, in the units users read (ms, tokens/s)."""
    ok = [r for r in outcome.results if r.success]
    failed = [r for r in outcome.results if not r.success]
    duration = outcome.duration_s
    output_tokens = sum(r.output_tokens for r in ok)
    usage_prompt = [r for r in ok if r.prompt_tokens is not None]
    if len(usage_prompt) == len(ok):
        input_tokens, input_source = sum(r.prompt_tokens or 0 for r in ok), "usage"
    else:
        input_tokens, input_source = sum(r.approx_input_tokens for r in ok), "approx_words"
    with_cache_field = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens or 0 for r in with_cache_field)
    cache_base = sum(r.prompt_tokens or 0 for r in with_cache_field)
    good = count_good(slo, ((r.ttft_s, r.tpot_s, r.e2e_s) for r in ok)) if slo.is_set() else None
    sources = sorted({r.output_tokens_source for r in ok})
    return {
        "max_concurrency": outcome.max_concurrency,
        "request_rate": None if math.isinf(outcome.request_rate) else outcome.request_rate,
        "num_cards": num_cards,
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error or "" for r in failed})[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "input_tokens_source": input_source,
        "total_output_tokens": output_tokens,
        "output_tokens_source": sources[0] if len(sources) == 1 else ("mixed" if sources else None),
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "output_throughput_per_card": output_tokens / duration / num_cards,
        # Little's law: time-averaged number of requests in flight.
        "mean_concurrency": sum(r.e2e_s or 0.0 for r in ok) / duration,
        "mean_input_tokens": input_tokens / len(ok) if ok else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "cached_prompt_tokens": cached if with_cache_field else None,
        "prefix_cache_hit_rate": cached / cache_base if cache_base else None,
        "requests_reporting_cached_tokens": len(with_cache_field),
        "slo": {"ttft_ms": _to_ms(slo.ttft_s), "tpot_ms": _to_ms(slo.tpot_s), "e2e_ms": _to_ms(slo.e2e_s)},
        "good_requests": good,
        "goodput": good / duration if good is not None else None,
        "ttft_ms": _ms(summarize(r.ttft_s for r in ok if r.ttft_s is not None)),
        "tpot_ms": _ms(summarize(r.tpot_s for r in ok if r.tpot_s is not None)),
        "itl_ms": _ms(summarize(gap for r in ok for gap in r.itl_s)),
        "e2e_ms": _ms(summarize(r.e2e_s for r in ok if r.e2e_s is not None)),
    }


def _to_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def load_config_dict(load: LoadConfig) -> dict[str, Any]:
    record = asdict(load)
    record["request_rate"] = None if math.isinf(load.request_rate) else load.request_rate
    return record
