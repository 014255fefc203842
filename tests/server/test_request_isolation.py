"""One request's failure inside the engine step (its grammar, its KV-store write) or in the API
side's detokenization ends that request only: the others stream to the end, /health stays 200,
the next request is served and no KV block is left in use.

The server runs in this process (engine on a thread, the real app over ASGI) so that a real
component can be made to fail for one request only, by a marker in that request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deepinfer.config import EngineConfig, ServerConfig
from deepinfer.engine.connectors.offload import KVOffloader
from deepinfer.frontend.output_processor import OutputProcessor
from deepinfer.server.app import build_app
from deepinfer.server.serve import start_state
from deepinfer.structured.llguidance_backend import LLGuidanceGrammar
from tests.server.conftest import MODEL
from tests.server.server_process import SMALL_KV

POISON = "poison"


class _FailingMatcher:
    """A real matcher that breaks on its first accepted token."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        raise RuntimeError("injected grammar failure")


@pytest.fixture
def faults(monkeypatch) -> Iterator[None]:
    new_matcher = LLGuidanceGrammar.new_matcher

    def matcher(self: LLGuidanceGrammar) -> Any:
        inner = new_matcher(self)
        return _FailingMatcher(inner) if POISON in json.dumps(self.spec.schema) else inner

    save = KVOffloader._save

    def save_chunks(self: KVOffloader, seq: Any) -> None:
        if seq.request.cache_salt == POISON:
            raise OSError("injected store write failure")
        save(self, seq)

    advance = OutputProcessor._advance

    def advance_text(self: OutputProcessor, request: Any, state: Any, out: Any) -> Any:
        if request.prompt and request.prompt.startswith(POISON):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return advance(self, request, state, out)

    monkeypatch.setattr(LLGuidanceGrammar, "new_matcher", matcher)
    monkeypatch.setattr(KVOffloader, "_save", save_chunks)
    monkeypatch.setattr(OutputProcessor, "_advance", advance_text)
    yield


def _victims() -> dict[str, tuple[str, dict[str, Any]]]:
    schema = {"type": "object", "properties": {POISON: {"type": "string"}}, "required": [POISON]}
    long_prompt = " ".join(["cache"] * 300)  # at least one 256-token chunk reaches the store
    return {
        "grammar": (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Give me JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
        ),
        "store write": ("/v1/completions", {"prompt": long_prompt, "cache_salt": POISON}),
        "detokenization": ("/v1/completions", {"prompt": f"{POISON} and more"}),
    }


async def _stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await client.post(path, json={"model": MODEL, "stream": True, "max_tokens": 12, **body})
    assert response.status_code == 200
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_failing_request_ends_alone(faults, tmp_path) -> None:
    async def run() -> None:
        state = await start_state(
            EngineConfig.from_kwargs(kv_cache_memory=int(SMALL_KV), kv_store=str(tmp_path)),
            ServerConfig(engine_mode="thread", log_level="warning"),
        )
        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://in-process", timeout=300
            ) as client:
                for stage, (path, body) in _victims().items():
                    healthy = {"prompt": "The capital of France is", "temperature": 0}
                    victim, *others = await asyncio.gather(
                        _stream(client, path, body),
                        *(_stream(client, "/v1/completions", healthy) for _ in range(2)),
                    )
                    assert any("error" in event for event in victim), f"{stage}: no error event in {victim}"
                    for events in others:
                        assert not any("error" in event for event in events), stage
                        finish = [
                            c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
                        ]
                        assert finish == ["length"], stage
                    assert (await client.get("/health")).status_code == 200, stage
                after = await _stream(client, "/v1/completions", {"prompt": "Hello", "temperature": 0})
                assert not any("error" in event for event in after)
                deadline = asyncio.get_running_loop().time() + 30
                while (
                    state.client.stats is None
                    or state.client.stats.num_free_blocks != state.client.stats.num_blocks
                ):
                    assert asyncio.get_running_loop().time() < deadline, "KV blocks left in use"
                    await asyncio.sleep(0.05)
        finally:
            await state.client.close()

    asyncio.run(run())
