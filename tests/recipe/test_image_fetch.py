"""Fetching image URLs: off by default, never to non-public addresses unless allowed, bounded in
size, time, redirects and content type. A local server on 127.0.0.1 stands in for the web (it
is reachable only with `allow_private`, which is itself under test)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deepinfer.recipe.api import anthropic_error_from, openai_error_from
from deepinfer.recipe.images import ImageInputError
from deepinfer.recipe.images.fetch import FetchPolicy, _public, fetch_image
from deepinfer.recipe.images.source import image_bytes
from deepinfer.recipe.ir import ImagePart

WHERE = "messages[0].content[0]"
BODY = b"\x89PNG\r\n\x1a\n" + b"x" * 1000
OPEN = FetchPolicy(enabled=True, allow_private=True, timeout_s=2.0)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        if "Content_Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        route = self.path.split("?", 1)[0]
        if route == "/a.png":
            self._send(200, BODY, Content_Type="image/png")
        elif route.startswith("/hop/"):
            left = int(route.rsplit("/", 1)[1])
            self._send(302, Location="/a.png" if left == 0 else f"/hop/{left - 1}")
        elif route == "/page":
            self._send(200, b"<html></html>", Content_Type="text/html")
        elif route == "/big":
            self._send(200, b"x" * 5000, Content_Type="image/png")
        elif route == "/big-unannounced":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"x" * 5000)
            self.close_connection = True
        elif route == "/slow":
            time.sleep(3)
            self._send(200, BODY, Content_Type="image/png")
        elif route == "/trickle":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):  # a byte every 50 ms: no single read times out, the whole does
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self._send(404)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that give up (timeouts, size limits) leave broken pipes behind: expected


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _refused(url: str, policy: FetchPolicy) -> str:
    with pytest.raises(ImageInputError) as refused:
        fetch_image(url, policy, WHERE)
    assert refused.value.param == WHERE
    return str(refused.value)


def test_fetching_is_off_by_default(server: str) -> None:
    assert "does not fetch image URLs" in _refused(f"{server}/a.png", FetchPolicy())


def test_loopback_is_refused_unless_private_addresses_are_allowed(server: str) -> None:
    assert "non-public address" in _refused(f"{server}/a.png", FetchPolicy(enabled=True))
    port = server.rsplit(":", 1)[1]
    assert "non-public address" in _refused(f"http://localhost:{port}/a.png", FetchPolicy(enabled=True))
    assert fetch_image(f"{server}/a.png", OPEN, WHERE) == BODY


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0"],
)
def test_non_public_ipv4_addresses(address: str) -> None:
    assert not _public(address)


@pytest.mark.parametrize(
    "address", ["::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "ff02::1"]
)
def test_non_public_ipv6_addresses(address: str) -> None:
    assert not _public(address)


def test_public_addresses_pass() -> None:
    assert _public("8.8.8.8") and _public("2606:4700:4700::1111") and _public("::ffff:8.8.8.8")


def test_redirects_are_followed_up_to_the_bound(server: str) -> None:
    assert fetch_image(f"{server}/hop/2", OPEN, WHERE) == BODY
    assert "redirected more than 3 times" in _refused(f"{server}/hop/5", OPEN)


def test_only_image_content_types(server: str) -> None:
    assert "text/html, not an image" in _refused(f"{server}/page", OPEN)


def test_size_bound_announced_or_not(server: str) -> None:
    small = FetchPolicy(enabled=True, allow_private=True, max_bytes=4000, timeout_s=2.0)
    assert "larger than 4000 bytes" in _refused(f"{server}/big", small)
    assert "larger than 4000 bytes" in _refused(f"{server}/big-unannounced", small)


def test_slow_and_trickling_servers_time_out(server: str) -> None:
    quick = FetchPolicy(enabled=True, allow_private=True, timeout_s=1.0)
    for route in ("/slow", "/trickle"):
        start = time.monotonic()
        assert "longer than 1 s" in _refused(f"{server}{route}", quick)
        # Refused at the 1 s deadline, before the server's 3 s answer or 5 s trickle would end.
        assert time.monotonic() - start < 3.0


def test_http_errors_and_bad_schemes(server: str) -> None:
    assert "HTTP 404" in _refused(f"{server}/missing.png", OPEN)
    assert "http(s)" in _refused("file:///etc/passwd", OPEN)


def test_an_image_part_by_url_is_fetched_only_under_the_policy(server: str) -> None:
    part = ImagePart(url=f"{server}/a.png", path="input[0].content[2]")
    with pytest.raises(ImageInputError) as refused:
        image_bytes(part, FetchPolicy())
    assert refused.value.param == "input[0].content[2]"
    assert image_bytes(part, OPEN) == BODY


def test_fetch_failures_are_400s_in_each_api_shape(server: str) -> None:
    with pytest.raises(ImageInputError) as refused:
        image_bytes(
            ImagePart(url=f"{server}/a.png", path="messages[1].content[0]"), FetchPolicy(enabled=True)
        )
    openai = openai_error_from(refused.value)["error"]
    assert (openai["type"], openai["param"]) == ("invalid_request_error", "messages[1].content[0]")
    assert "non-public address" in openai["message"]
    anthropic = anthropic_error_from(refused.value)
    assert anthropic["error"]["type"] == "invalid_request_error"
    assert anthropic["error"]["message"].startswith("messages[1].content[0]: ")
