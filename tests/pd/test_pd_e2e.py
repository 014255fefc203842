"""Prefill/decode disaggregation end to end, on loopback: 1 prefill + 2 decode engines behind the
router (the KV pulled over TCP), and a prefill/decode pair sharing a file store (the KV written
through and read back). Greedy output through them equals a single `deepinfer serve` on every API,
streamed and not, and on the edge cases: a prompt shorter than one block, a prompt the decoder
holds entirely while the prefiller holds none of it, and a partial hit on the decoder. The
cached tokens each answer reports show the KV came through the handoff (the decoders had none of
it), and once requests end no engine holds a block.
"""

from __future__ import annotations

import httpx
import pytest

from deepinfer.config.engine import DEFAULT_CHUNK_BLOCKS
from tests.pd.apis import APIS, ask
from tests.pd.cluster import (
    MODEL,
    SMALL,
    RouterProcess,
    engine_info,
    replica,
    reusable,
    start_all,
    stop_all,
    wait_all_blocks_free,
)
from tests.server.server_process import ServerProcess

pytestmark = pytest.mark.slow

TOPICS = ("rivers", "volcanoes", "glaciers", "deserts", "forests", "islands", "caves", "reefs")


def prompt(topic: str, sentences: int = 12) -> str:
    """About 13 tokens a sentence: a dozen make some full blocks of 16."""
    return " ".join(f"Fact {i} about {topic}: they shape the land in many ways." for i in range(sentences))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("kv-store"))
    through_store = ("--kv-transfer", "store", "--kv-store", store, "--kv-chunk-blocks", "1")
    servers = {
        "reference": ServerProcess(*SMALL),
        "prefill": replica("--role", "prefill"),
        "decode1": replica("--role", "decode"),
        "decode2": replica("--role", "decode"),
        "store_prefill": replica("--role", "prefill", *through_store),
        "store_decode": replica("--role", "decode", *through_store),
    }
    start_all(list(servers.values()))
    routers = []
    try:
        direct = RouterProcess(
            "--prefill",
            servers["prefill"].url,
            "--decode",
            servers["decode1"].url,
            "--decode",
            servers["decode2"].url,
        ).start()
        routers.append(direct)
        stored = RouterProcess(
            "--prefill", servers["store_prefill"].url, "--decode", servers["store_decode"].url
        ).start()
        routers.append(stored)
        for router in routers:
            router.wait_ready()
        yield {**servers, "router": direct, "store_router": stored}
    finally:
        for router in routers:
            router.kill()
        stop_all(list(servers.values()))


def engines(cluster, *names: str) -> list[ServerProcess]:
    return [cluster[name] for name in names]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_direct_handoff_matches_a_single_server(cluster, api, stream) -> None:
    text = prompt(TOPICS[APIS.index(api) * 2 + stream])
    expected, _, _ = ask(cluster["reference"].url, api, text, stream)
    answer, cached, prompt_tokens = ask(cluster["router"].url, api, text, stream)
    assert answer == expected
    # The decoders never saw this prompt: every reusable block came from the prefill engine.
    assert cached == reusable(prompt_tokens) > 0
    wait_all_blocks_free(engines(cluster, "prefill", "decode1", "decode2"))


@pytest.mark.parametrize(("api", "stream"), [("chat", True), ("messages", False), ("completions", False)])
def test_store_handoff_matches_a_single_server(cluster, api, stream) -> None:
    text = prompt("mountains " + api, 14)
    expected, _, _ = ask(cluster["reference"].url, api, text, stream)
    answer, cached, prompt_tokens = ask(cluster["store_router"].url, api, text, stream)
    assert answer == expected
    assert cached == reusable(prompt_tokens) > 0  # read back from the store, chunk by chunk
    wait_all_blocks_free(engines(cluster, "store_prefill", "store_decode"))


def test_a_prompt_shorter_than_one_block(cluster) -> None:
    for url in (cluster["router"].url, cluster["store_router"].url):
        answer, cached, prompt_tokens = ask(url, "completions", "Hi there", False)
        assert prompt_tokens < 16 and cached == 0
        assert answer == ask(cluster["reference"].url, "completions", "Hi there", False)[0]
    wait_all_blocks_free(engines(cluster, "prefill", "decode1", "decode2", "store_prefill", "store_decode"))


def test_a_full_hit_on_the_decoder_but_not_the_prefiller(cluster) -> None:
    text = prompt("canyons")
    expected, _, _ = ask(cluster["reference"].url, "completions", text, False)
    for name in ("decode1", "decode2"):  # both decoders hold the prompt; the prefiller does not
        ask(cluster[name].url, "completions", text, False)
    answer, cached, prompt_tokens = ask(cluster["router"].url, "completions", text, False)
    assert answer == expected and cached == reusable(prompt_tokens)
    # The decoder pulled nothing, which still ended the prefiller's lease at once.
    wait_all_blocks_free(engines(cluster, "prefill", "decode1", "decode2"), timeout_s=5.0)


def test_a_partial_hit_on_the_decoder(cluster) -> None:
    head, text = prompt("tundra", 6), prompt("tundra", 14)
    expected, _, _ = ask(cluster["reference"].url, "completions", text, False)
    for name in ("decode1", "decode2"):
        _, _, head_tokens = ask(cluster[name].url, "completions", head, False)
    answer, cached, prompt_tokens = ask(cluster["router"].url, "completions", text, False)
    assert answer == expected
    assert cached == reusable(prompt_tokens) > reusable(head_tokens)  # its own part, then the rest pulled
    wait_all_blocks_free(engines(cluster, "prefill", "decode1", "decode2"))


def test_engine_info_names_the_chunks_each_engine_moves(cluster) -> None:
    # Prefill and decode engines cut their handoffs into chunks of --kv-chunk-blocks with or
    # without a store; a plain engine with neither a store nor a PD role cuts none.
    chunk_blocks = {
        name: engine_info(cluster[name])["kv_chunk_blocks"] for name in cluster if "router" not in name
    }
    assert chunk_blocks == {
        "reference": 0,
        "prefill": DEFAULT_CHUNK_BLOCKS,
        "decode1": DEFAULT_CHUNK_BLOCKS,
        "decode2": DEFAULT_CHUNK_BLOCKS,
        "store_prefill": 1,
        "store_decode": 1,
    }


def test_request_ids_pass_through_and_errors_keep_their_shape(cluster) -> None:
    url = cluster["router"].url
    reply = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"x-request-id": "trace-42"},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42"
    assert reply.headers["x-deepinfer-replica"] in (cluster["decode1"].url, cluster["decode2"].url)
    bad = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 2}, timeout=60)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert "messages" in bad.json()["error"]["message"]
    bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": "nope"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    models = httpx.get(url + "/v1/models", timeout=60).json()
    assert models["data"][0]["id"] == MODEL
