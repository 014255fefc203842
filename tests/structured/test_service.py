"""The compile service: cache, shared compilations, clear errors, and a timeout that does not stall
other requests."""

from __future__ import annotations

import time

import pytest

from deepinfer.sampling_params import InvalidRequestError, StructuredOutputs
from deepinfer.structured.errors import GrammarCompileError
from deepinfer.structured.service import GrammarCompileService
from deepinfer.structured.spec import GrammarSpec, canonical_json
from tests.structured.schemas import PATHOLOGICAL, SUITE, UNSUPPORTED


@pytest.fixture
def service(backend):
    svc = GrammarCompileService(backend, timeout_s=10.0, max_workers=2)
    yield svc
    svc.close()


def test_cache_and_shared_compilation(service):
    schema = SUITE["nested_objects"]
    first = service.submit(GrammarSpec.json(schema))
    # Same schema with its keywords in another order, submitted while the first may still run.
    reordered = {k: schema[k] for k in reversed(list(schema))}
    second = service.submit(GrammarSpec.json(reordered))
    assert second is first
    assert first.wait(10)
    grammar = first.result()
    assert service.submit(GrammarSpec.json(schema)).result() is grammar
    assert service.stats.compiles_started == 1
    assert service.stats.cache_hits == 2
    # Each request gets its own matcher state.
    a, b = grammar.new_matcher(), grammar.new_matcher()
    assert a is not b


def test_property_order_is_part_of_the_key():
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    b = {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "type": "object"}
    c = {"type": "object", "properties": {"y": {"type": "integer"}, "x": {"type": "integer"}}}
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) != canonical_json(c)
    assert GrammarSpec.json(a).cache_key == GrammarSpec.json(b).cache_key
    assert GrammarSpec.json(a).cache_key != GrammarSpec.json(a).with_reasoning().cache_key


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_keyword_is_named(service, name):
    schema, expected = UNSUPPORTED[name]
    handle = service.submit(GrammarSpec.json(schema))
    assert handle.wait(10)
    assert handle.error is not None and handle.error.kind == "unsupported"
    assert expected in handle.error.message
    with pytest.raises(GrammarCompileError) as info:
        handle.result()
    assert isinstance(info.value, InvalidRequestError)  # the server's 400 path
    assert info.value.param == "structured_outputs.json"
    assert expected in str(info.value)


def test_unsupported_message_example(service):
    handle = service.submit(GrammarSpec.json({"type": "object", "dependentRequired": {"a": ["b"]}}))
    handle.wait(10)
    assert (
        handle.error.message == "structured_outputs.json: unsupported JSON Schema keyword 'dependentRequired'"
    )


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (lambda: GrammarSpec.regex("(unclosed"), "invalid regex"),
        (lambda: GrammarSpec.regex("(?=look)ahead"), "look-ahead"),
        (lambda: GrammarSpec.grammar("start: missing_rule\n"), "invalid grammar"),
        (lambda: GrammarSpec.grammar('root ::= "a" undefined'), "invalid grammar"),
        (lambda: GrammarSpec.json({"type": "object", "properties": 5}), "invalid JSON Schema"),
        (lambda: GrammarSpec.json({"$ref": "#/$defs/missing"}), "structured_outputs.json"),
    ],
)
def test_invalid_specs_fail_with_a_message(service, spec, needle):
    handle = service.submit(spec())
    assert handle.wait(10)
    assert handle.error is not None
    assert needle in handle.error.message
    assert len(handle.error.message) <= 600


def test_malformed_specs_fail_before_queueing():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        GrammarSpec.json("{not json")
    with pytest.raises(InvalidRequestError, match="accepts no output"):
        GrammarSpec.json(False)
    with pytest.raises(InvalidRequestError, match=r"choice\[1\]"):
        GrammarSpec.choice(["a", ""])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        GrammarSpec.from_structured_outputs(StructuredOutputs(regex="a", choice=["b"]))
    spec = GrammarSpec.from_structured_outputs(StructuredOutputs(json='{"type": "integer"}'))
    assert spec.kind == "json" and spec.schema == {"type": "integer"}
    assert GrammarSpec.from_structured_outputs(StructuredOutputs(json_object=True)).schema == {
        "type": "object"
    }


def test_timeout_does_not_block_other_requests(backend):
    service = GrammarCompileService(backend, timeout_s=0.5, max_workers=2)
    try:
        started = time.monotonic()
        slow = service.submit(GrammarSpec.json(PATHOLOGICAL))
        quick = service.submit(GrammarSpec.json(SUITE["event_record"]))
        assert quick.wait(5), "another request's grammar must compile while the slow one runs"
        assert quick.error is None
        assert not slow.done() or slow.error.kind == "timeout"
        assert slow.wait(5)
        elapsed = time.monotonic() - started
        assert slow.error is not None and slow.error.kind == "timeout"
        assert "took longer than 0.5 s" in slow.error.message
        assert elapsed < 3.0  # failed at the deadline, not when the compile finally ended
        # The service keeps working while the abandoned compile still runs in the background.
        assert service.num_abandoned_running == 1
        later = service.submit(GrammarSpec.regex("[0-9]{3}"))
        assert later.wait(5) and later.error is None
        # Resubmitting the same schema fails fast from the cache instead of compiling again.
        again = service.submit(GrammarSpec.json(PATHOLOGICAL))
        assert again.done() and again.error.kind == "timeout"
        assert service.stats.timed_out == 1
        # The timeout meant something: the abandoned compile needed far longer than the deadline.
        while service.num_abandoned_running and time.monotonic() - started < 60:
            time.sleep(0.05)
        assert service.num_abandoned_running == 0
        assert time.monotonic() - started > 1.5
    finally:
        service.close()
