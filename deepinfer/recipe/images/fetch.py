"""Fetching an image URL for a client, without letting the client reach what the server reaches.

Off unless the server enables it (`FetchPolicy.enabled`). When on, each request (the first and
every redirect, at most `max_redirects`) goes only to http(s), the host is resolved once and
every address it resolves to must be public (loopback, private, link-local, CGNAT, multicast
and reserved ranges are refused unless `allow_private`), and the connection is made to the
address that was checked, so a second DNS answer cannot point it elsewhere. The body must be a
PNG, JPEG, GIF or WebP by its Content-Type, at most `max_bytes`, and the whole fetch, redirects
included, must end within `timeout_s` (a server that trickles bytes is cut off too).

Blocking by design: the server runs it off the event loop. Every failure is an
ImageInputError naming the image part.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from deepinfer.recipe.images.decode import MAX_IMAGE_BYTES, MEDIA_TYPES
from deepinfer.recipe.images.errors import ImageInputError

MAX_URL_LENGTH = 8192  # DeepSeek's codec refuses longer links too
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(slots=True, frozen=True)
class FetchPolicy:
    enabled: bool = False
    allow_private: bool = False
    max_bytes: int = MAX_IMAGE_BYTES
    timeout_s: float = 10.0
    max_redirects: int = 3


def check_image_url(url: str, where: str) -> None:
    """What can be said of an image URL without fetching it (parse time)."""
    if len(url) > MAX_URL_LENGTH:
        raise ImageInputError(where, f"the URL is longer than {MAX_URL_LENGTH} characters")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageInputError(where, "the image URL must be a data: URL or an http(s) URL with a host")


def refuse_unless_fetching(policy: FetchPolicy, where: str) -> None:
    """An ImageInputError naming the part unless the policy lets this server fetch image URLs."""
    if not policy.enabled:
        raise ImageInputError(
            where, "this server does not fetch image URLs; send the image inline (a data: URL or base64)"
        )


def fetch_image(url: str, policy: FetchPolicy, where: str) -> bytes:
    """The body of an image URL, within the policy's bounds."""
    refuse_unless_fetching(policy, where)
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(policy.max_redirects + 1):
        check_image_url(url, where)
        status, headers, body = _get(url, policy, deadline, where)
        if status in _REDIRECTS:
            location = headers.get("location")
            if not location:
                raise ImageInputError(where, f"the image URL answered {status} without a Location")
            url = urllib.parse.urljoin(url, location)
            continue
        if status != 200:
            raise ImageInputError(where, f"the image URL answered HTTP {status}")
        return body
    raise ImageInputError(where, f"the image URL redirected more than {policy.max_redirects} times")


def _get(url: str, policy: FetchPolicy, deadline: float, where: str) -> tuple[int, dict[str, str], bytes]:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _vetted_address(host, port, policy.allow_private, where)
    conn = _connection(parts.scheme, host, address, port, max(deadline - time.monotonic(), 0.001))
    try:
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn.request("GET", path, headers={"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*"})
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.status != 200:
            return response.status, headers, b""
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type not in MEDIA_TYPES:
            raise ImageInputError(
                where, f"the image URL sent {media_type or 'no content type'}, not an image"
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise ImageInputError(where, f"the image is larger than {policy.max_bytes} bytes")
        body = bytearray()
        while chunk := _read_some(conn, response, deadline):
            body += chunk
            if len(body) > policy.max_bytes:
                raise ImageInputError(where, f"the image is larger than {policy.max_bytes} bytes")
        return 200, headers, bytes(body)
    except (OSError, http.client.HTTPException) as error:
        if isinstance(error, TimeoutError) or time.monotonic() >= deadline:
            raise ImageInputError(
                where, f"fetching the image took longer than {policy.timeout_s:g} s"
            ) from None
        raise ImageInputError(where, f"fetching the image failed ({type(error).__name__})") from None
    finally:
        conn.close()


def _read_some(
    conn: http.client.HTTPConnection, response: http.client.HTTPResponse, deadline: float
) -> bytes:
    """The next piece of the body, waiting no longer than the fetch has left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)
    return response.read1(_CHUNK)


def _vetted_address(host: str, port: int, allow_private: bool, where: str) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise ImageInputError(where, f"the image host {host!r} does not resolve") from None
    addresses = [info[4][0] for info in infos]
    if not allow_private:
        for address in addresses:
            if not _public(address):
                raise ImageInputError(where, f"the image host {host!r} resolves to a non-public address")
    return addresses[0]


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _connection(
    scheme: str, host: str, address: str, port: int, timeout: float
) -> http.client.HTTPConnection:
    """A connection to the vetted `address` that still names `host` (Host header, TLS SNI and
    certificate check)."""
    if scheme == "https":
        return _PinnedHTTPS(host, address, port, timeout)
    return http.client.HTTPConnection(address, port, timeout=timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]
