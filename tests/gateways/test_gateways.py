"""Our replicas behind the gateways users already run: two `deepinfer serve` replicas (default
model, small KV) fronted by SGLang Model Gateway and by vllm-router, each with round-robin and
cache-aware routing. Every API streams through each of them (the SDKs parse the streams, the text
is the replica's own), round robin spreads requests over both replicas, cache-aware keeps a
conversation on the replica that holds it, and a replica killed mid-run loses no request that
had not started. The gateways come from `make gateways` (build/gateways); a missing one is
skipped, naming the target. What each gateway reads from us is in docs/deployment.md."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from deepinfer.server.metrics import VLLM_ALIASES
from tests.gateways.gateway_process import GatewayProcess, installed
from tests.pd.apis import APIS, ask
from tests.pd.cluster import MODEL, cached_tokens, replica, reusable, start_all, stop_all
from tests.server.server_process import ServerProcess, metric_value, wait_until

pytestmark = pytest.mark.slow

GATEWAYS = ("smg", "vllm-router")
POLICIES = ("round_robin", "cache_aware")


@pytest.fixture(scope="module")
def replicas():
    servers = [replica() for _ in range(2)]
    start_all(servers)
    try:
        yield servers
    finally:
        stop_all(servers)


@pytest.fixture(scope="module")
def fronts(replicas):
    workers = [s.url for s in replicas]
    started: dict[tuple[str, str], GatewayProcess] = {}
    try:
        for gateway in GATEWAYS:
            if installed(gateway):
                for policy in POLICIES:
                    started[gateway, policy] = GatewayProcess(gateway, workers, policy).start()
        for front in started.values():
            front.wait_ready()
        yield started
    finally:
        for front in started.values():
            front.kill()


@pytest.fixture(scope="module")
def direct(replicas) -> dict[str, str]:
    """Each API's greedy answer straight from a replica, streamed: what the gateways must relay."""
    return {api: ask(replicas[0].url, api, _prompt(api), stream=True)[0] for api in APIS}


def _prompt(api: str) -> str:
    return f"Name two facts about the {api} API."


def front_of(fronts, gateway: str, policy: str) -> GatewayProcess:
    if (gateway, policy) not in fronts:
        pytest.skip(f"{gateway} is not installed (`make gateways` installs it under build/gateways)")
    return fronts[gateway, policy]


def requests_served(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(metric_value(text, "deepinfer_requests_total", {"outcome": o}) for o in ("stop", "length"))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("gateway", GATEWAYS)
def test_every_api_streams_through(direct, fronts, gateway, policy) -> None:
    front = front_of(fronts, gateway, policy)
    for api in APIS:
        assert direct[api]
        assert ask(front.url, api, _prompt(api), stream=True)[0] == direct[api], (api, front.log_tail())


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_round_robin_spreads_requests_over_both_replicas(replicas, fronts, gateway) -> None:
    front = front_of(fronts, gateway, "round_robin")
    before = [requests_served(s) for s in replicas]
    for i in range(4):
        assert ask(front.url, "chat", f"Count to {i}.", stream=False)[0]
    after = [requests_served(s) for s in replicas]
    assert sum(after) - sum(before) == 4
    assert all(a > b for a, b in zip(after, before)), (before, after)


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_cache_aware_keeps_a_conversation_where_it_is_cached(fronts, gateway) -> None:
    front = front_of(fronts, gateway, "cache_aware")
    messages = [
        {
            "role": "system",
            "content": f"You guide walks ({gateway}). " + "List every stop with its time. " * 12,
        }
    ]
    previous_prompt = 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"Plan day {turn} of the walk along the river."})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(front.url + "/v1/chat/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        if turn:  # the whole previous prompt is a hit: the turn went where the conversation is
            assert cached_tokens(usage) >= reusable(previous_prompt), (turn, usage)
        previous_prompt = usage["prompt_tokens"]
        messages.append(reply.json()["choices"][0]["message"])


def test_replicas_expose_the_metric_names_llm_d_reads(replicas) -> None:
    """Queue, running and KV usage under vLLM's names, the same values as ours (one scrape)."""
    text = httpx.get(replicas[0].url + "/metrics", timeout=10).text
    for alias, name in VLLM_ALIASES.items():
        assert metric_value(text, alias) == metric_value(text, "deepinfer_" + name), alias
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= set(
        VLLM_ALIASES
    )


def _long_stream(url: str, started: set[str]) -> str:
    """A stream that runs while the replica dies: its first token arrives, then it reads on
    until the stream ends one way or another."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long tale."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        contextlib.suppress(httpx.HTTPError),
        httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as stream,
    ):
        for line in stream.iter_lines():
            if '"content":"' in line:
                started.add(url)
    started.add(url)  # it failed before its first token: nothing to wait for
    return url


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_started(replicas, fronts) -> None:
    """Runs last in this module: it kills one of the shared replicas while streams run through
    every round-robin gateway. Requests sent after it died all succeed: chat and completions at
    once (both gateways retry them on another worker), the Responses and Messages APIs at once
    through SMG, and through vllm-router once its health check took the replica out (0.1.17 does
    not retry those two routes: a request it sends to the dead worker before then gets 502)."""
    targets = [f for (_, policy), f in fronts.items() if policy == "round_robin"]
    if not targets:
        pytest.skip("no gateway is installed (`make gateways`)")
    victim = replicas[1]
    started: set[str] = set()
    with ThreadPoolExecutor(len(targets)) as pool:
        running = [pool.submit(_long_stream, f.url, started) for f in targets]
        for front in targets:  # streams through every gateway are under way
            assert wait_until(lambda front=front: front.url in started, 120.0), front.log_tail()
        victim.kill()
        for i in range(4):  # twice round the replicas: every other one would go to the dead one
            for front in targets:
                api = ("chat", "completions")[i % 2]
                assert ask(front.url, api, f"After the crash, request {i}.", stream=True)[0], front
        for front in targets:
            if front.gateway == "vllm-router":
                assert wait_until(lambda front=front: not front.worker_healthy(victim.url), 60.0)
            for api in APIS:
                for i in range(2):
                    assert ask(front.url, api, f"Later, request {i}.", stream=True)[0], (front, api)
        for future in running:
            future.result(timeout=180)  # the streams in flight ended (with or without an error)
