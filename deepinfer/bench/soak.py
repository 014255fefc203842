"""`deepinfer bench soak`: one server under a mixed, partly hostile load, checked for what must
never happen.

Requests go to all four generation APIs (Chat Completions, Completions, Responses, Messages) at
up to `--concurrency` at once: half of them streamed, `--cancel-fraction` of the streams dropped
by the client after their first token, `--malformed-fraction` malformed bodies (broken JSON,
wrong types, missing fields, out-of-range values), and prompts that share one of a few long
prefixes (prefix-cache hits) or not. Figures: 5xx count (must be 0), malformed bodies answered
with a 4xx in their API's error shape (must be all), KV blocks in use once the load is over
(must be 0), the server's RSS (API + engine process) after the run against after warm-up (must
stay within 10%), TTFT p50/p99 of the streams that were not cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deepinfer.bench.cluster import replica, running
from deepinfer.bench.report import markdown_table, provenance, write_json

APIS = ("chat", "completions", "responses", "messages")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
]


@dataclass(slots=True)
class Tally:
    sent: int = 0
    ok: int = 0
    server_errors: int = 0  # 5xx
    malformed: int = 0
    malformed_well_answered: int = 0  # a 4xx in the API's error shape
    cancelled: int = 0
    stream_errors: int = 0  # an error event inside a stream that was not malformed
    other_failures: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


def _prefixes(rng: random.Random, count: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def _prompt(rng: random.Random, prefixes: list[str], hit_fraction: float) -> str:
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
    if rng.random() < hit_fraction:
        return f"{rng.choice(prefixes)}\n{tail}"
    return tail


def _body(api: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    if api == "chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    if api == "completions":
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if api == "responses":
        return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": stream}
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _malformed(api: str, body: dict[str, Any], rng: random.Random) -> bytes:
    """A body the server must refuse with a 4xx."""
    kind = rng.randrange(4)
    if kind == 0:
        return json.dumps(body).encode()[:-3]  # cut JSON
    broken = dict(body)
    limit = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens"}.get(
        api, "max_tokens"
    )
    if kind == 1:
        broken[limit] = "many"
    elif kind == 2:
        broken.pop({"chat": "messages", "completions": "prompt", "responses": "input"}.get(api, "messages"))
    else:
        broken["temperature"] = -3
    return json.dumps(broken).encode()


def _error_shaped(api: str, text: str) -> bool:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return False
    if api == "messages":
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)


def _is_token(api: str, payload: dict[str, Any]) -> bool:
    if api == "chat":
        choices = payload.get("choices") or [{}]
        return bool((choices[0].get("delta") or {}).get("content"))
    if api == "completions":
        choices = payload.get("choices") or [{}]
        return bool(choices[0].get("text"))
    if api == "responses":
        return payload.get("type") == "response.output_text.delta"
    return payload.get("type") == "content_block_delta"


def _is_error(api: str, payload: dict[str, Any]) -> bool:
    if api in ("chat", "completions"):
        return "error" in payload
    return payload.get("type") in ("error", "response.failed")


async def _one(
    http: httpx.AsyncClient, api: str, content: bytes, stream: bool, cancel: bool, bad: bool, tally: Tally
) -> None:
    tally.sent += 1
    start = time.perf_counter()
    headers = {"content-type": "application/json"}
    try:
        async with http.stream("POST", PATHS[api], content=content, headers=headers) as response:
            if response.status_code >= 500:
                tally.server_errors += 1
                tally.other_failures.append(
                    f"{api} {response.status_code}: {(await response.aread())[:200]!r}"
                )
                return
            if bad:
                tally.malformed += 1
                text = (await response.aread()).decode(errors="replace")
                if 400 <= response.status_code < 500 and _error_shaped(api, text):
                    tally.malformed_well_answered += 1
                else:
                    tally.other_failures.append(f"malformed {api}: {response.status_code} {text[:200]}")
                return
            if response.status_code != 200:
                tally.other_failures.append(
                    f"{api} {response.status_code}: {(await response.aread())[:200]!r}"
                )
                return
            if not stream:
                await response.aread()
                tally.ok += 1
                return
            first = True
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                if _is_error(api, payload):
                    tally.stream_errors += 1
                    tally.other_failures.append(f"{api} stream error: {line[:200]}")
                    return
                if first and _is_token(api, payload):
                    first = False
                    if cancel:
                        tally.cancelled += 1
                        return  # leaving the block closes the connection mid-stream
                    tally.ttft_s.append(time.perf_counter() - start)
            tally.ok += 1
    except httpx.HTTPError as error:
        tally.other_failures.append(f"{api} transport: {error!r}")


def _rss_bytes(pids: list[int]) -> list[int]:
    """The resident set of each process."""
    sizes = []
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                sizes.append(int(line.split()[1]) * 1024)
    return sizes


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def _load(args: argparse.Namespace, url: str, model: str, count: int, seed: int) -> Tally:
    rng = random.Random(seed)
    prefixes = _prefixes(rng, args.prefixes, args.prefix_words)
    tally = Tally()
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency)
    deadline = time.monotonic() + args.time_limit_s
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s, limits=limits) as http:

        async def guarded(*job: Any) -> None:
            async with gate:
                if time.monotonic() < deadline:
                    await _one(http, *job, tally)

        jobs = []
        for i in range(count):
            api = APIS[i % len(APIS)]
            stream = rng.random() < 0.5
            body = _body(api, model, _prompt(rng, prefixes, args.hit_fraction), args.max_tokens, stream)
            bad = rng.random() < args.malformed_fraction
            content = _malformed(api, body, rng) if bad else json.dumps(body).encode()
            cancel = stream and rng.random() < args.cancel_fraction
            jobs.append(guarded(api, content, stream, cancel, bad))
        await asyncio.gather(*jobs)
    return tally


def _mib(sizes: list[int]) -> str:
    return " + ".join(f"{size / 2**20:.0f}" for size in sizes)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace) -> int:
    store = Path(tempfile.mkdtemp(prefix="deepinfer-bench-soak-")) / "responses.sqlite3"
    server = replica(
        "soak",
        "--response-store",
        f"sqlite:{store}",
        "--max-waiting-requests",
        str(args.concurrency * 4),
        threads=args.threads,
        kv_cache_memory=args.kv_cache_memory,
    )
    with running([server]):
        info = httpx.get(server.url + "/health", timeout=30).json()
        assert server.process is not None
        pids = [server.process.pid, int(info["engine"]["pid"])]
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warmup = args.warmup if args.warmup is not None else 2 * args.concurrency
        warm = asyncio.run(_load(args, server.url, model, warmup, args.seed + 1))
        rss_warm = _rss_bytes(pids)
        started = time.perf_counter()
        tally = asyncio.run(_load(args, server.url, model, args.num_requests, args.seed))
        duration = time.perf_counter() - started
        used_blocks, running_now = -1.0, -1.0
        idle_deadline = time.monotonic() + 30
        while time.monotonic() < idle_deadline:
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            used_blocks = _metric(metrics, "deepinfer_kv_cache_used_blocks")
            running_now = _metric(metrics, "deepinfer_num_requests_running")
            if used_blocks == 0 and running_now == 0:
                break
            time.sleep(0.5)
        rss_after = _rss_bytes(pids)
        healthy = httpx.get(server.url + "/health", timeout=30).status_code == 200
    rss_growth = sum(rss_after) / sum(rss_warm) - 1
    ttft_p50, ttft_p99 = _percentile(tally.ttft_s, 0.5), _percentile(tally.ttft_s, 0.99)
    passed = (
        tally.server_errors == 0
        and tally.malformed == tally.malformed_well_answered
        and used_blocks == 0
        and abs(rss_growth) <= 0.10
        and healthy
        and warm.server_errors == 0
    )
    rows = [
        ["requests sent / ok", f"{tally.sent} / {tally.ok}"],
        ["5xx", tally.server_errors],
        ["malformed: 4xx in the API's shape", f"{tally.malformed_well_answered}/{tally.malformed}"],
        ["streams cancelled mid-way", tally.cancelled],
        ["errors inside streams", tally.stream_errors],
        ["other failures", len(tally.other_failures)],
        ["KV blocks in use at the end", int(used_blocks)],
        ["RSS after warm-up / after run, API + engine (MiB)", f"{_mib(rss_warm)} / {_mib(rss_after)}"],
        ["RSS growth", f"{rss_growth:+.1%}"],
        ["TTFT p50 / p99 (ms)", f"{(ttft_p50 or 0) * 1e3:.0f} / {(ttft_p99 or 0) * 1e3:.0f}"],
        ["run (s)", f"{duration:.0f}"],
        ["verdict", "pass" if passed else "FAIL"],
    ]
    print(markdown_table(["soak", "value"], rows))
    for failure in tally.other_failures[:10]:
        print("  ", failure)
    if args.result_json:
        write_json(
            args.result_json,
            {
                "benchmark": "soak",
                **provenance(),
                "options": {
                    k: v for k, v in vars(args).items() if isinstance(v, str | int | float | type(None))
                },
                "sent": tally.sent,
                "ok": tally.ok,
                "server_errors": tally.server_errors,
                "malformed": tally.malformed,
                "malformed_well_answered": tally.malformed_well_answered,
                "cancelled": tally.cancelled,
                "stream_errors": tally.stream_errors,
                "other_failures": tally.other_failures,
                "kv_blocks_in_use_at_end": used_blocks,
                "rss_processes": ["api", "engine"],
                "rss_warm_bytes": rss_warm,
                "rss_after_bytes": rss_after,
                "ttft_p50_s": ttft_p50,
                "ttft_p99_s": ttft_p99,
                "duration_s": duration,
                "passed": passed,
            },
        )
    return 0 if passed else 1


def add_parser(commands: Any) -> argparse.ArgumentParser:
    p = commands.add_parser("soak", help="mixed hostile load on one server: no 5xx, no leaks, bounded RSS")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests before the RSS baseline (default: 2 x --concurrency, so that the baseline has "
        "seen batches as large as the run's)",
    )
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.2, help="of the streams")
    p.add_argument("--malformed-fraction", type=float, default=0.1)
    p.add_argument("--hit-fraction", type=float, default=0.5, help="prompts that start with a shared prefix")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="the engine's threads")
    p.add_argument("--kv-cache-memory", default="384MiB")
    p.add_argument("--time-limit-s", type=float, default=900.0, help="no new requests after this")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write the full result here")
    return p
