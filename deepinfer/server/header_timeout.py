"""A deadline on reading a request's headers (slowloris).

uvicorn bounds an idle keep-alive connection but not one that sends its headers a byte at a
time: hundreds of those hold sockets and file descriptors forever. This protocol closes a
connection whose headers are not complete within `seconds` of its opening, or of the end of
its previous response; once the headers are in, the request's own limits apply.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11) with the header deadline; pass it as `http=`."""
    base: Any = AutoHTTPProtocol

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers get their own deadline

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # still waiting for a request's headers
                self.transport.close()

    return HeaderTimeoutProtocol
