"""Tenants are isolated by default (issue 30, findings 7, 9 and 11).

With API keys, one key's cached prefix is no hit for another (`cached_tokens` is no oracle),
/metrics and /reset_prefix_cache belong to an admin key, and the keyless /health says whether
the server is up and nothing about the machine behind it.
"""

from __future__ import annotations

import httpx

from tests.security.conftest import ADMIN_KEY, MODEL, TENANT_A, TENANT_B, as_key, error_of

SECRET = "Patient record: name Jane Roe, SSN 078-05-1120, diagnosis confidential. " * 12


def _cached_tokens(server, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 1}
    with server.client(key) as http:
        reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return (reply.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_one_tenants_prompt_is_no_cache_hit_for_another(tenants) -> None:
    _cached_tokens(tenants, TENANT_A)
    assert _cached_tokens(tenants, TENANT_A) > 0  # the cache works within a tenant
    assert _cached_tokens(tenants, TENANT_B) == 0  # and says nothing across tenants


def test_metrics_and_the_cache_reset_are_not_a_tenants(tenants) -> None:
    for key in (None, TENANT_A):
        error = error_of(httpx.get(tenants.url + "/metrics", headers=as_key(key)), 403)
        assert "--admin-key" in error["message"]
        error = error_of(httpx.post(tenants.url + "/reset_prefix_cache", headers=as_key(key)), 403)
        assert "--admin-key" in error["message"]


def test_the_admin_key_reads_metrics_and_resets_the_cache(guarded) -> None:
    assert error_of(httpx.get(guarded.url + "/metrics", headers=as_key(TENANT_A)), 401)
    assert error_of(httpx.post(guarded.url + "/reset_prefix_cache", headers=as_key(TENANT_B)), 401)
    metrics = httpx.get(guarded.url + "/metrics", headers=as_key(ADMIN_KEY))
    assert metrics.status_code == 200 and "deepinfer_kv_cache_used_blocks" in metrics.text
    reset = httpx.post(guarded.url + "/reset_prefix_cache", headers=as_key(ADMIN_KEY))
    assert reset.status_code == 200 and reset.json() == {"reset": True}
    # The admin key is not a tenant's: the API itself still wants an API key.
    assert error_of(httpx.get(guarded.url + "/v1/models", headers=as_key(ADMIN_KEY)), 401)


def test_keyless_health_reveals_nothing_internal(tenants, guarded) -> None:
    assert httpx.get(tenants.url + "/health").json() == {"status": "ok"}
    assert httpx.get(tenants.url + "/health", headers=as_key(TENANT_A)).json() == {"status": "ok"}
    detail = httpx.get(guarded.url + "/health", headers=as_key(ADMIN_KEY)).json()
    assert detail["status"] == "ok" and detail["engine"]["pid"] == guarded.engine_pid
