"""The router's retries and circuit breakers, in process: the router's own app and replica set,
with upstream replicas played by an httpx transport that can fail on demand (a replica that
passes its health checks and yet refuses or 503s every request is what a breaker is for)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deepinfer.config.router import RouterConfig
from deepinfer.router.app import Router, build_app
from deepinfer.router.index import PrefixIndex
from deepinfer.router.metrics import RouterMetrics
from deepinfer.router.replica import ReplicaSet
from deepinfer.store.breaker import BreakerState

GOOD, BAD = "http://good:1", "http://bad:1"


class Upstreams:
    """Both replicas answer health checks; BAD fails every request the chosen way."""

    def __init__(self, failure: str) -> None:
        self.failure = failure
        self.requests: dict[str, int] = {GOOD: 0, BAD: 0}
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/v1/engine_info":
            return httpx.Response(200, json={"healthy": True, "role": "both", "load": {}})
        self.requests[base] += 1
        self.headers.append(request.headers)
        if base == BAD:
            if self.failure == "refused":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(503, json={"error": {"message": "engine down"}})
        return httpx.Response(200, json={"ok": True})


async def _run(
    failure: str, requests: int, headers: dict[str, str] | None = None
) -> tuple[list[int], Upstreams, ReplicaSet]:
    upstreams = Upstreams(failure)
    config = RouterConfig(
        replicas=(BAD, GOOD),
        policy="round_robin",
        breaker_failures=2,
        breaker_cooldown=60,
        health_interval=60,
    )
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
    index = PrefixIndex()
    replicas = ReplicaSet(config, index, client)
    await replicas.start()
    router = Router(config, replicas, index, None, client, RouterMetrics())
    app = httpx.AsyncClient(transport=httpx.ASGITransport(build_app(router)), base_url="http://router")
    statuses = []
    for _ in range(requests):
        reply = await app.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
        statuses.append(reply.status_code)
    await replicas.close()
    await client.aclose()
    return statuses, upstreams, replicas


@pytest.mark.parametrize("failure", ["refused", "503"])
def test_failures_before_the_first_byte_are_retried_and_open_the_breaker(failure) -> None:
    statuses, upstreams, replicas = asyncio.run(_run(failure, 8))
    assert statuses == [200] * 8  # every request that met BAD was retried on GOOD
    bad = next(r for r in replicas.replicas if r.url == BAD)
    assert bad.breaker.state is BreakerState.OPEN
    # Two failures opened the circuit; after that BAD was not tried again (cooldown: 60 s).
    assert upstreams.requests[BAD] == 2 and upstreams.requests[GOOD] == 8


def test_a_client_cannot_point_a_decoder_at_kv_of_its_choosing() -> None:
    forged = {"x-deepinfer-kv-transfer": '{"address": "evil:1", "transfer_id": "x"}', "x-request-id": "r-1"}
    statuses, upstreams, _ = asyncio.run(_run("503", 1, forged))
    assert statuses == [200]
    assert all("x-deepinfer-kv-transfer" not in h for h in upstreams.headers)
    assert all(h["x-request-id"] == "r-1" for h in upstreams.headers)  # request ids do pass
