"""`deepinfer router` in front of two real replicas sharing a file store: every route passes
through (streams byte for byte, each API's SDK works), cache-aware routing keeps a growing
conversation on the replica that holds it while round robin scatters it, a shared store is
credited to both replicas, a replica killed mid-stream ends its streams with an error event and
the next requests go to the other, and SIGTERM drains requests in flight.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.pd.apis import APIS, ask
from tests.pd.cluster import (
    MODEL,
    RouterProcess,
    replica,
    reusable,
    start_all,
    stop_all,
    wait_all_blocks_free,
)
from tests.server.server_process import metric_value, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("shared-store"))
    servers = [replica("--kv-store", store, "--kv-chunk-blocks", "1") for _ in range(2)]
    start_all(servers)
    routers: dict[str, RouterProcess] = {}
    try:
        urls = [arg for s in servers for arg in ("--replica", s.url)]
        for policy in ("cache_aware", "round_robin"):
            routers[policy] = RouterProcess(*urls, "--policy", policy).start()
        for router in routers.values():
            router.wait_ready()
        yield {"replicas": servers, **routers}
    finally:
        for router in routers.values():
            router.kill()
        stop_all(servers)


def chat(url: str, messages: list[dict], max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply


@pytest.mark.parametrize("api", APIS)
def test_every_api_passes_through(cluster, api) -> None:
    router, direct = cluster["cache_aware"].url, cluster["replicas"][0].url
    text = f"Name two {api} facts."
    for stream in (False, True):
        assert ask(router, api, text, stream)[0] == ask(direct, api, text, stream)[0]


def test_streams_are_relayed_frame_for_frame(cluster) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "stream": True}
    frames = {}
    for name, url in (("router", cluster["cache_aware"].url), ("direct", cluster["replicas"][1].url)):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.headers["content-type"].startswith("text/event-stream")
        # Ids and timestamps differ per request; the frames' shapes and texts must not.
        frames[name] = [
            {k: v for k, v in json.loads(f[6:]).items() if k not in ("id", "created")}
            if f != "data: [DONE]"
            else f
            for f in reply.text.split("\n\n")
            if f
        ]
    assert frames["router"] == frames["direct"]


def test_other_routes_pass_through(cluster) -> None:
    url = cluster["cache_aware"].url
    messages = [{"role": "user", "content": "Hi"}]
    tokens = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=60).json()
    assert tokens["count"] > 0
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=60).json()["prompt"]
    assert "Hi" in text
    counted = httpx.post(
        url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": messages}, timeout=60
    )
    assert counted.json()["input_tokens"] == tokens["count"]


def _session(turns: int, seed: int) -> list[list[dict]]:
    history: list[dict] = [
        {
            "role": "system",
            "content": f"Session {seed}. " + "You plan trips carefully and list each stop. " * 6,
        }
    ]
    conversations = []
    for turn in range(turns):
        history.append(
            {"role": "user", "content": f"Turn {turn}: plan day {turn} of a walk along river {seed}."}
        )
        conversations.append(list(history))
        history.append(
            {"role": "assistant", "content": f"Day {turn}: walk, rest, eat, and sleep near the river."}
        )
    return conversations


def test_cache_aware_keeps_a_conversation_where_its_prefix_is(cluster) -> None:
    router = cluster["cache_aware"]
    for seed in range(3):
        served, hits = [], []
        for turn, messages in enumerate(_session(3, seed)):
            reply = chat(router.url, messages)
            served.append(reply.headers["x-deepinfer-replica"])
            usage = reply.json()["usage"]
            hits.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
            time.sleep(0.3)  # the KV events of this turn reach the router
            if turn:
                # The whole previous prompt is a hit: its own device blocks, on the same replica.
                assert hits[-1][0] >= reusable(hits[-2][1])
        assert len(set(served)) == 1, served
    decisions = httpx.get(router.url + "/metrics", timeout=10).text
    by_cache = 0.0  # every turn after a session's first, on whichever replica holds the session
    for server in cluster["replicas"]:
        labels = {"reason": "cache", "replica": server.url}
        with contextlib.suppress(KeyError):
            by_cache += metric_value(decisions, "deepinfer_router_routing_decisions_total", labels)
    assert by_cache >= 6
    assert metric_value(decisions, "deepinfer_router_hit_rate_estimate") > 0.3


def test_round_robin_scatters_a_conversation(cluster) -> None:
    served = [chat(cluster["round_robin"].url, m).headers["x-deepinfer-replica"] for m in _session(4, 10)]
    assert len(set(served)) == 2


def test_a_shared_store_is_credited_to_every_replica(cluster) -> None:
    text = httpx.get(cluster["cache_aware"].url + "/metrics", timeout=10).text
    for server in cluster["replicas"]:
        labels = {"replica": server.url, "tier": "STORE"}
        assert metric_value(text, "deepinfer_router_index_blocks", labels) > 0


def test_sigterm_drains_requests_in_flight(cluster) -> None:
    urls = [arg for s in cluster["replicas"] for arg in ("--replica", s.url)]
    router = RouterProcess(*urls, "--drain-timeout", "60").start()
    router.wait_ready()
    body = {
        "model": MODEL,
        "prompt": "Count:",
        "max_tokens": 40,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", router.url + "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        assert router.process is not None
        router.process.terminate()
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest)
    assert router.process.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(router.url + "/health", timeout=5)


def test_a_replica_killed_mid_stream(cluster) -> None:
    router = cluster["cache_aware"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long tale."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=httpx.Timeout(60.0)) as client,
        client.stream("POST", router.url + "/v1/chat/completions", json=body) as stream,
    ):
        serving = stream.headers["x-deepinfer-replica"]
        victim = next(s for s in cluster["replicas"] if s.url == serving)
        survivor = next(s for s in cluster["replicas"] if s.url != serving)
        lines = stream.iter_lines()
        next(line for line in lines if '"content":"' in line and '"content":""' not in line)
        victim.kill()
        rest = list(lines)
    assert any(line.startswith("data: {") and '"error"' in line for line in rest)
    assert not any(serving.split("//")[1] in line for line in rest)  # the replica's address is internal
    for stream_mode in (False, True):  # later requests succeed on the other one
        assert ask(router.url, "messages", "Hello again", stream_mode)[0]
    assert wait_until(
        lambda: router.health()["replicas"][cluster["replicas"].index(victim)]["healthy"] is False, 10
    )
    wait_all_blocks_free([survivor])


def test_router_errors_are_in_each_api_shape() -> None:
    router = RouterProcess("--replica", "http://127.0.0.1:9", "--max-body-bytes", "1000").start()
    try:
        assert httpx.get(router.url + "/health", timeout=10).status_code == 503
        reply = httpx.post(router.url + "/v1/messages", json={"model": MODEL, "messages": []}, timeout=30)
        assert reply.status_code == 503 and reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] in ("overloaded_error", "api_error")
        reply = httpx.post(
            router.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30
        )
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_replica_available"
        reply = httpx.post(router.url + "/v1/chat/completions", content=b"x" * 2000, timeout=30)
        assert reply.status_code == 413 and "limit" in reply.json()["error"]["message"]
    finally:
        router.kill()
