"""The server's side of a `previous_response_id`: the conversation it brings back (every turn's
input then output, in order) and the 400 naming the field once a turn expired, on the store's
injectable clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deepinfer.response_store import ResponseStore, StoredResponse, tenant_of
from deepinfer.server.errors import ApiError
from deepinfer.server.stored_responses import StoredResponses
from deepinfer.store import ManualClock
from tests.response_store.conftest import StoreFactory

ALICE = tenant_of("sk-alice")


def turn(
    response_id: str, items: list[dict[str, Any]], output: list[dict[str, Any]], ancestors: list[str]
) -> StoredResponse:
    return StoredResponse(
        response_id=response_id,
        tenant=ALICE,
        response={"id": response_id, "object": "response", "status": "completed", "output": output},
        input_items=items,
        ancestors=ancestors,
        traffic_class="agent",
    )


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"}
CUT = {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{", "status": "incomplete"}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "t"}],
}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "42"}


def fill(store: ResponseStore) -> None:
    store.put(turn("r1", [USER], [REASONING, CALL], []))
    store.put(turn("r2", [OUTPUT], [{"type": "message", "role": "assistant", "content": []}, CUT], ["r1"]))


def test_every_item_in_order_and_cut_calls_left_out(make_store: StoreFactory) -> None:
    store = make_store()
    fill(store)
    continuation = asyncio.run(StoredResponses(store).continuation(ALICE, "r2"))
    kinds = [item["type"] for item in continuation.items]
    assert kinds == ["message", "reasoning", "function_call", "function_call_output", "message"]
    assert continuation.ancestors == ["r1", "r2"]


def test_an_expired_turn_is_a_400_naming_the_field(make_store: StoreFactory, clock: ManualClock) -> None:
    store = make_store()
    fill(store)
    responses = StoredResponses(store)
    clock.advance(50)  # agent: 60 s from the last use
    assert asyncio.run(responses.continuation(ALICE, "r2")).ancestors == ["r1", "r2"]
    clock.advance(61)
    with pytest.raises(ApiError) as expired:
        asyncio.run(responses.continuation(ALICE, "r2"))
    assert expired.value.status == 400 and expired.value.param == "previous_response_id"
    with pytest.raises(ApiError) as other:
        asyncio.run(responses.continuation(tenant_of("sk-bob"), "r2"))
    assert other.value.status == 400


def test_no_store_refuses_previous_response_id() -> None:
    with pytest.raises(ApiError) as refused:
        asyncio.run(StoredResponses(None).continuation(ALICE, "r1"))
    assert refused.value.param == "previous_response_id"
