"""Time limits on slow or unfinished requests (docs/customizer.md#access).

uvicorn's own settings cover what they can: `timeout_keep_alive` closes a connection idle between
requests, `h11_max_incomplete_event_size` bounds the request line and headers. uvicorn has no
limit on how long the headers may take, so `DeadlineH11Protocol` adds one: a connection whose
request line and headers are not complete within `header_timeout` seconds of its first byte (or
of the connection) is answered 408 and closed, however slowly bytes keep trickling in. A
response sent before its request's body was read whole (a 401, a 413, the body deadline's 408 of
`guard.RequestGuard`) closes the connection, so the rest of that body is never waited for.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from dpojax.customizer.client.errors import require_extra

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE = 5
MAX_HEADER_BYTES = 64 * 1024


def timeout_answer(message: str) -> bytes:
    """A whole HTTP/1.1 408 answer with the server's JSON error body, closing the connection."""
    body = json.dumps({"detail": message, "error": message}).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def protocol_class(header_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline of `header_timeout` seconds on each request's
    line and headers (the class is made here: uvicorn is an optional extra)."""
    if not header_timeout > 0:
        raise ValueError(f"the header timeout must be positive, got {header_timeout}")
    return type("DeadlineH11Protocol", (_deadline_base(),), {"header_timeout": header_timeout})


@functools.cache
def _deadline_base() -> type:
    h11 = require_extra("h11")
    require_extra("uvicorn")
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a deadline on each request's line and headers."""

        header_timeout: float = DEFAULT_HEADER_TIMEOUT

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_deadline is None:
                late = self.loop.call_later(self.header_timeout, self._headers_late)
                self._header_deadline = late

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            message = f"request headers not complete within {self.header_timeout:g} s"
            self.transport.write(timeout_answer(message))
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # IDLE: the next request's headers are still incomplete (the deadline runs from
            # its first byte, and is not pushed back by later bytes).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Answered while the request's body is still coming (no next cycle was started).
            state = self.conn.our_state, self.conn.their_state
            if state == (h11.DONE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return DeadlineH11Protocol
