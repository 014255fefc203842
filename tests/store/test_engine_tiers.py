"""The engine on top of the KV tiers: hits across processes, through a file store and Redis,
faults that must end in a recompute with correct output, and retention by traffic class."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.store import FileBackend, TieredKVStore

PROMPT = (
    "<|im_start|>system\n"
    + "You are a meticulous assistant. Cite the rules before you answer. " * 45
    + "<|im_end|>\n<|im_start|>user\nSummarize the rules.<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
WRITER = """
import sys
from deepinfer import LLM, SamplingParams
llm = LLM(kv_store=sys.argv[1], kv_cache_memory=128 << 20)
llm.generate(sys.argv[2], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False,
             traffic_class=sys.argv[3])
llm.close()
"""


def prefill_in_another_process(store: str, traffic_class: str = "chat") -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-c", WRITER, store, PROMPT, traffic_class], check=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def cold(default_llm):
    """The reference: the same prompt with no tiers at all."""
    return default_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def engine(default_llm, store: str) -> LLM:
    return LLM(loaded=default_llm.engine.core.loaded, kv_store=store, kv_cache_memory=128 << 20)


def test_second_process_hits_what_the_first_prefilled(default_llm, cold, tmp_path):
    store = str(tmp_path / "kv")
    prefill_in_another_process(store, traffic_class="agent")
    llm = engine(default_llm, store)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    chunk_tokens = 16 * 16
    assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // chunk_tokens * chunk_tokens > 0
    assert out.outputs[0].token_ids == cold
    assert llm.engine.core.connector.metrics()["store_hits"] >= 1
    # Retention by class: the file store keeps each object's expiry as its mtime (agent: 3 days).
    objects = [p for p in Path(store).rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert objects
    for path in objects:
        assert abs(path.stat().st_mtime - (time.time() + 3 * 86400)) < 3600
    llm.close()


def test_chunks_are_installed_while_later_ones_are_still_read(default_llm, cold, tmp_path, monkeypatch):
    """The engine writes each chunk into its blocks as it arrives: the first is in device blocks
    while the read of the second is held, and the request waits for the whole load."""
    store = str(tmp_path / "kv")
    prefill_in_another_process(store)
    requested: list[bytes] = []
    release = threading.Event()
    load, get = TieredKVStore.load, FileBackend.get

    def recording_load(self, keys, namespace, arrived=None):
        requested.extend(keys)
        return load(self, keys, namespace, arrived)

    def held_get(self, key, now):
        if len(requested) > 1 and key == requested[1]:
            assert release.wait(timeout=60)
        return get(self, key, now)

    monkeypatch.setattr(TieredKVStore, "load", recording_load)
    monkeypatch.setattr(FileBackend, "get", held_get)
    llm = engine(default_llm, store)
    outputs = []
    worker = threading.Thread(target=lambda: outputs.extend(llm.generate(PROMPT, GREEDY, use_tqdm=False)))
    worker.start()
    connector = llm.engine.core.connector
    try:
        deadline = time.monotonic() + 60
        while connector.loaded_chunks < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(requested) == 2 and connector.loaded_chunks == 1 and worker.is_alive()
    finally:
        release.set()  # a failed check must not leave the request waiting on the held read
        worker.join(timeout=120)
    assert connector.loaded_chunks == 2
    assert outputs[0].num_cached_tokens == 2 * 16 * 16 and outputs[0].outputs[0].token_ids == cold
    llm.close()


def test_redis_store_shared_across_processes(default_llm, cold, redis_server):
    prefill_in_another_process(redis_server.url)
    llm = engine(default_llm, redis_server.url)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == cold
    llm.close()


def test_corrupted_objects_are_misses_and_output_stays_correct(default_llm, cold, tmp_path):
    store = str(tmp_path / "kv")
    prefill_in_another_process(store)
    for path in Path(store).rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            stat = path.stat()
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF  # flip one payload byte
            path.write_bytes(bytes(data))
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # keep its expiry: only the bytes change
    llm = engine(default_llm, store)
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold
    assert llm.engine.core.connector.metrics()["corrupt_objects"] >= 1
    llm.close()


def test_redis_killed_mid_run_then_back(default_llm, cold, redis_server):
    llm = engine(default_llm, redis_server.url)
    redis_server.kill()
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]  # writes fail softly, reads miss
    assert out.outputs[0].token_ids == cold
    redis_server.start()
    deadline = time.time() + 60
    while time.time() < deadline:  # the breaker probes and closes once Redis answers again
        llm.reset_prefix_cache()
        variant = PROMPT.replace("Summarize", f"Recite {time.time()}")
        llm.generate(variant, GREEDY, use_tqdm=False)
        llm.engine.core.connector.store.flush(timeout=10)
        llm.reset_prefix_cache()
        again = llm.generate(variant, GREEDY, use_tqdm=False)[0]
        if again.num_cached_tokens > 0:
            break
        time.sleep(1)
    assert again.num_cached_tokens > 0
    llm.close()
