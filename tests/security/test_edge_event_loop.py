"""One request never stalls the server (issue 30, findings 5 and 10).

A prompt of megabytes is read, parsed and tokenized off the event loop, so /health is answered
while it is; a body nested a thousand levels deep, or a JSON schema hundreds of levels deep, is
a 400 naming the field instead of a RecursionError's 500.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.security.conftest import MODEL, TENANT_A, as_key, error_of

BIG_PROMPT_WORDS = 600_000  # 3 MB of text: seconds of tokenization, far past the context


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "word " * BIG_PROMPT_WORDS, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "word " * BIG_PROMPT_WORDS}]},
        ),
    ],
    ids=["completions", "chat"],
)
def test_health_is_answered_while_a_huge_prompt_is_tokenized(tenants, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    uploaded = threading.Event()
    finished: list[str] = []
    answers: dict[str, httpx.Response] = {}

    def chunks() -> Iterator[bytes]:
        for at in range(0, len(data), 1 << 20):
            yield data[at : at + (1 << 20)]
        uploaded.set()  # the last chunk is written: the server now parses and tokenizes

    def big() -> None:
        headers = {**as_key(TENANT_A), "content-type": "application/json"}
        answers["big"] = httpx.post(tenants.url + path, content=chunks(), headers=headers, timeout=300)
        finished.append("big")

    sender = threading.Thread(target=big)
    sender.start()
    assert uploaded.wait(300)
    answers["health"] = httpx.get(tenants.url + "/health", timeout=300)
    finished.append("health")
    sender.join()
    assert answers["health"].status_code == 200
    # The prompt was tokenized whole (its count is in the error), after /health was answered.
    error = error_of(answers["big"], 400)
    assert "600" in error["message"] and error["param"] in ("prompt", "messages")
    assert finished == ["health", "big"]


def _deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_schema(depth: int) -> str:
    # Written as text: the client's own json module would overflow its stack encoding it.
    opening = '{"type": "object", "required": ["a"], "properties": {"a": '
    return opening * depth + '{"type": "string"}' + "}}" * depth


CHAT = '{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": %s}]}'
SCHEMA = (
    '{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], '
    '"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": %s}}}'
)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", CHAT % (MODEL, _deep_list(1000)), "messages"),
        ("/v1/chat/completions", SCHEMA % (MODEL, _deep_schema(300)), "response_format"),
        ("/v1/completions", '{"prompt": ' + _deep_list(1000) + "}", "prompt"),
        ("/v1/responses", '{"input": ' + _deep_list(1000) + "}", "input"),
        ("/tokenize", '{"prompt": ' + _deep_list(5000) + "}", "prompt"),
    ],
    ids=["chat-content", "chat-schema", "completions", "responses", "tokenize"],
)
def test_deep_nesting_is_a_400_naming_the_field(tenants, path: str, body: str, field: str) -> None:
    with tenants.client(TENANT_A) as http:
        reply = http.post(path, content=body, headers={"content-type": "application/json"})
        error = error_of(reply, 400)
        assert error["param"].startswith(field) and "nested" in error["message"]
        assert http.get("/health").status_code == 200


def test_deep_nesting_on_the_messages_api_is_an_anthropic_400(tenants) -> None:
    body = CHAT % (MODEL, _deep_list(1000))
    with tenants.client(TENANT_A) as http:
        reply = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["type"] == "error" and "nested" in reply.json()["error"]["message"]


def test_special_spellings_are_found_across_scan_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe scans client text in windows (each search holds the GIL briefly); spellings
    that straddle a window's edge are swapped exactly as one scan of the whole text swaps them."""
    import random

    from deepinfer.recipe import tokens

    guard = tokens.SpecialTextGuard(["<|im_start|>", "<|im_end|>", "<think>", "<｜User｜>"])
    monkeypatch.setattr(tokens, "_WINDOW", 7)
    rng = random.Random(30)
    parts = [
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "<｜User｜>",
        "a",
        "bc",
        " ",
        "<",
        "|",
        chr(0x100000),
        chr(0x100005),
    ]
    for _ in range(2000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
        protected = guard.protect_text(text)
        assert protected == guard._in_re.sub(guard._swap_in, text), text
        assert guard.restore(protected) == text
        specials = [piece for piece, special in guard.segments(text) if special]
        assert specials == guard._special_re.findall(text)


def test_a_prompt_past_the_context_is_counted_without_its_ids() -> None:
    """Turning millions of ids into a list holds the GIL (and the event loop) for tens of
    milliseconds: past the limit, the count comes back, exact, and no list is made."""
    from deepinfer.recipe.tokens import prompt_tokenizer
    from deepinfer.router.prompt import PromptRenderer
    from deepinfer.validation import PromptTooLong

    tokenizer = PromptRenderer.load(None, None).tokenizer
    text = "A river runs through it. " * 40
    assert tokenizer.encode(text, max_tokens=10_000) == tokenizer.backend.encode(text).ids
    with pytest.raises(PromptTooLong) as too_long:
        tokenizer.encode(text, max_tokens=10)
    assert too_long.value.num_tokens == len(tokenizer.backend.encode(text).ids)
    pieces = [("<|im_start|>", True), ("user\n" + text, False), ("<|im_end|>", True), ("<|im_start|>", True)]
    whole = prompt_tokenizer(tokenizer.backend).encode(pieces, strict=False)
    assert prompt_tokenizer(tokenizer.backend).encode(pieces, strict=False, max_tokens=len(whole)) == whole
    for limit in (0, 1, len(whole) - 2, len(whole) - 1):  # past it in a marker, in text, at the end
        with pytest.raises(PromptTooLong) as too_long:
            prompt_tokenizer(tokenizer.backend).encode(pieces, strict=False, max_tokens=limit)
        assert too_long.value.num_tokens == len(whole)
