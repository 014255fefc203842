"""The router's own routes hold to what `deepinfer serve`'s do (issue 30, finding 11).

Real routers on loopback in front of a keyed engine: /health is keyless and says only the
status (no replica's address), /metrics (whose labels are the replicas' URLs) and
/reset_prefix_cache are an admin key's, refused outright with API keys and no admin key, and
`--public-metrics` opens /metrics alone. A tenant's answers name no replica either.
"""

from __future__ import annotations

import httpx
import pytest

from tests.pd.cluster import RouterProcess
from tests.security.conftest import ADMIN_KEY, MODEL, TENANT_A, TENANT_B, as_key, error_of

TENANTS = ("--api-key", TENANT_A, "--api-key", TENANT_B)


@pytest.fixture(scope="module")
def routers(guarded):
    flags = {
        "admin": (*TENANTS, "--admin-key", ADMIN_KEY),
        "no_admin": TENANTS,
        "public": (*TENANTS, "--public-metrics"),
    }
    started: dict[str, RouterProcess] = {}
    try:
        for name, extra in flags.items():
            started[name] = RouterProcess("--replica", guarded.url, *extra).start()
        for process in started.values():
            process.wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


def _internal(guarded) -> str:
    return guarded.url.removeprefix("http://")  # host:port of the engine behind the routers


def test_health_is_keyless_and_names_no_replica(routers, guarded) -> None:
    for router in routers.values():
        for key in (None, TENANT_A):
            reply = httpx.get(router.url + "/health", headers=as_key(key), timeout=10)
            assert reply.status_code == 200 and reply.json() == {"status": "ok"}
            assert _internal(guarded) not in reply.text
    detail = httpx.get(routers["admin"].url + "/health", headers=as_key(ADMIN_KEY), timeout=10).json()
    assert detail["status"] == "ok" and [r["url"] for r in detail["replicas"]] == [guarded.url]


def test_metrics_are_the_admins(routers) -> None:
    admin = routers["admin"].url + "/metrics"
    for key in (None, TENANT_A, "sk-not-a-key"):
        assert error_of(httpx.get(admin, headers=as_key(key), timeout=10), 401)
    reply = httpx.get(admin, headers=as_key(ADMIN_KEY), timeout=10)
    assert reply.status_code == 200 and "deepinfer_router_replica_healthy" in reply.text
    # API keys and no admin key: no tenant may read them (as on `deepinfer serve`).
    for key in (None, TENANT_B):
        error = error_of(
            httpx.get(routers["no_admin"].url + "/metrics", headers=as_key(key), timeout=10), 403
        )
        assert "--admin-key" in error["message"] and "--public-metrics" in error["message"]
    public = httpx.get(routers["public"].url + "/metrics", timeout=10)
    assert public.status_code == 200 and "deepinfer_router_replica_healthy" in public.text


def test_the_cache_reset_is_the_admins(routers, guarded) -> None:
    for key in (None, TENANT_A):
        reply = httpx.post(routers["admin"].url + "/reset_prefix_cache", headers=as_key(key), timeout=30)
        error_of(reply, 401)
        assert _internal(guarded) not in reply.text
        reply = httpx.post(routers["no_admin"].url + "/reset_prefix_cache", headers=as_key(key), timeout=30)
        assert "--admin-key" in error_of(reply, 403)["message"]
    # The router passes the admin key on: the engine behind it checks it too.
    reset = httpx.post(routers["admin"].url + "/reset_prefix_cache", headers=as_key(ADMIN_KEY), timeout=30)
    assert reset.status_code == 200 and reset.json() == {"reset": True, "replicas": {guarded.url: 200}}


def test_a_tenants_answer_names_no_replica(routers, guarded) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for name in ("admin", "public"):
        for stream in (False, True):
            reply = httpx.post(
                routers[name].url + "/v1/chat/completions",
                json={**body, "stream": stream},
                headers=as_key(TENANT_A),
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            assert "x-deepinfer-replica" not in reply.headers
            assert not any(_internal(guarded) in value for value in reply.headers.values())
