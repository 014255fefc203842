"""Both response stores (SQLite file, real redis-server) behind one interface: records, tenants,
retention on an injectable clock, the size cap, stream events and cancellation."""

from __future__ import annotations

from typing import Any

from deepinfer.response_store import StoredResponse, tenant_of
from deepinfer.store import ManualClock
from tests.response_store.conftest import StoreFactory

ALICE, BOB = tenant_of("sk-alice"), tenant_of("sk-bob")


def response(response_id: str, status: str = "completed", text: str = "hi") -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "status": status,
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
        ],
    }


def record(response_id: str, tenant: str = ALICE, **fields: Any) -> StoredResponse:
    status = fields.pop("status", "completed")
    return StoredResponse(
        response_id=response_id,
        tenant=tenant,
        response=response(response_id, status, fields.pop("text", "hi")),
        input_items=[{"id": f"msg_{response_id}", "type": "message", "role": "user", "content": []}],
        **fields,
    )


def test_round_trip_survives_reopening(make_store: StoreFactory) -> None:
    first = make_store()
    written = record("resp_1", ancestors=["resp_0"], traffic_class="agent")
    first.put(written)
    first.close()
    again = make_store().get(ALICE, "resp_1")
    assert again == written


def test_another_tenant_finds_nothing(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("resp_1"))
    assert store.get(BOB, "resp_1") is None
    assert store.delete(BOB, "resp_1") is False
    assert store.events_after(BOB, "resp_1", -1) is None
    assert store.get(ALICE, "resp_1") is not None


def test_get_many_keeps_the_order_and_marks_the_missing(make_store: StoreFactory) -> None:
    store = make_store()
    for name in ("a", "b", "c"):
        store.put(record(name))
    found = store.get_many(ALICE, ["c", "x", "a"])
    assert [r.response_id if r else None for r in found] == ["c", None, "a"]


def test_delete(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("resp_1"), frames=["event: a\n\n"])
    assert store.delete(ALICE, "resp_1") is True
    assert store.get(ALICE, "resp_1") is None
    assert store.delete(ALICE, "resp_1") is False
    assert store.total_bytes() == 0


def test_expiry_per_traffic_class_from_the_last_use(make_store: StoreFactory, clock: ManualClock) -> None:
    store = make_store()
    store.put(record("chat", traffic_class="chat"))  # 1 h
    store.put(record("agent", traffic_class="agent"))  # 60 s
    clock.advance(50)
    assert store.get(ALICE, "agent") is not None  # a use: 60 s from now
    clock.advance(50)
    assert store.get(ALICE, "agent") is not None
    clock.advance(61)
    assert store.get(ALICE, "agent") is None
    assert store.get(ALICE, "chat") is not None
    clock.advance(3601)
    assert store.get(ALICE, "chat") is None
    assert store.events_after(ALICE, "chat", -1) is None
    assert store.advance(ALICE, "chat", ["x"]) is None


def test_size_cap_evicts_the_least_recently_used(make_store: StoreFactory, clock: ManualClock) -> None:
    probe = make_store()
    probe.put(record("probe", text="x" * 1000))
    one = probe.total_bytes()
    probe.delete(ALICE, "probe")
    store = make_store(max_bytes=int(one * 4.5))
    for i in range(4):
        store.put(record(f"r{i}", text="x" * 1000))
        clock.advance(1)
    assert store.get(ALICE, "r0") is not None  # used: now the most recent
    clock.advance(1)
    store.put(record("r4", text="x" * 1000))
    kept = [r.response_id for r in store.get_many(ALICE, [f"r{i}" for i in range(5)]) if r]
    assert kept == ["r0", "r2", "r3", "r4"]
    assert store.total_bytes() <= one * 4.5


def test_events_append_in_order_and_read_after_a_sequence_number(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("bg", status="queued", background=True, done=False), frames=["f0", "f1"])
    assert store.advance(ALICE, "bg", ["f2", "f3"], response("bg", "in_progress")) == "in_progress"
    assert store.advance(ALICE, "bg", ["f4"]) == "in_progress"
    page = store.events_after(ALICE, "bg", 1)
    assert page is not None and page.frames == ["f2", "f3", "f4"] and not page.done
    assert store.advance(ALICE, "bg", ["f5"], response("bg", "completed", "done"), done=True) == "completed"
    page = store.events_after(ALICE, "bg", -1)
    assert page is not None and page.frames == [f"f{i}" for i in range(6)]
    assert page.status == "completed" and page.done
    again = make_store().get(ALICE, "bg")
    assert again is not None and again.response["output"][0]["content"][0]["text"] == "done"


def test_a_cancel_wins_over_a_later_status(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("bg", status="in_progress", background=True, done=False))
    other_replica = make_store()
    cancelled = other_replica.cancel(ALICE, "bg", response("bg", "in_progress"))
    assert cancelled is not None and cancelled.status == "cancelled"
    # The run, elsewhere, finishes after the cancel: its output is kept, its status is not.
    assert (
        store.advance(ALICE, "bg", ["end"], response("bg", "completed", "partial"), done=True) == "cancelled"
    )
    final = store.get(ALICE, "bg")
    assert final is not None and final.status == "cancelled" and final.done
    assert final.response["output"][0]["content"][0]["text"] == "partial"


def test_a_finished_response_cannot_be_cancelled(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("done"))
    after = store.cancel(ALICE, "done", response("done"))
    assert after is not None and after.status == "completed"
    assert store.cancel(BOB, "done", response("done")) is None


def test_accounting_returns_to_zero(make_store: StoreFactory) -> None:
    store = make_store()
    store.put(record("a"), frames=["x" * 10])
    store.advance(ALICE, "a", ["y" * 20], response("a", "completed", "longer text"))
    store.put(record("a"))  # replaced
    store.put(record("b"))
    assert store.delete(ALICE, "a") and store.delete(ALICE, "b")
    assert store.total_bytes() == 0
