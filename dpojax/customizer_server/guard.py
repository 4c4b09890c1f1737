"""The request guard of the local server (ASGI middleware): every body is bounded and, when it is
JSON, holds only what JSON can round-trip, before any route sees it
(docs/customizer.md#request-validation).

- a body over `max_body_bytes` (declared by `Content-Length` or counted while reading) is refused
  with 413 without being kept;
- a body not read whole within `body_timeout` seconds of its headers is refused with 408 (and the
  connection closed: `deadlines`);
- a JSON body (`application/json`, or NDJSON line by line) with `NaN` / `Infinity`, a number
  that overflows to infinity (`1e400`), or nested deeper than `MAX_DEPTH`, is refused with 422. (Python's parser accepts non-finite numbers;
  stored, they made every later list of jobs or deployments fail to serialise.)
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from dpojax.customizer_server.common import error

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 60.0
MAX_DEPTH = 32


class BodyRejected(ValueError):
    """A body the guard refuses; `status` is the answer's status code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _refuse_constant(name: str) -> float:
    raise BodyRejected(422, f"request body holds {name}: JSON numbers must be finite")


def _finite_float(text: str) -> float:
    """A JSON number that Python reads as a float: refused when it overflows to infinity
    (`1e400`), which `json.loads` accepts without calling `parse_constant`."""
    value = float(text)
    if math.isinf(value):
        raise BodyRejected(422, f"request body holds {text[:40]}: JSON numbers must be finite")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json(text: str | bytes) -> Any:
    """`text` parsed as JSON; `BodyRejected` for non-finite numbers or deep nesting (malformed
    JSON raises ValueError)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise BodyRejected(422, f"request body is nested deeper than {MAX_DEPTH}") from None
    if _depth(value) > MAX_DEPTH:
        raise BodyRejected(422, f"request body is nested deeper than {MAX_DEPTH}")
    return value


def _content_type(scope: dict) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-type":
            return value.decode("latin-1").split(";")[0].strip().lower()
    return ""


def _declared_length(scope: dict) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _check_body(body: bytes, content_type: str) -> None:
    if not body:
        return
    try:
        if content_type in ("", "application/json") or content_type.endswith("+json"):
            check_json(body)
        elif content_type == "application/x-ndjson":
            for line in body.splitlines():
                if line.strip():
                    check_json(line)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, BodyRejected):
            raise
        # Malformed JSON: the route's own parsing reports it (422).


class RequestGuard:
    """ASGI middleware enforcing the module docstring's rules."""

    def __init__(
        self,
        app: Any,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
    ) -> None:
        self.app, self.max_body_bytes, self.body_timeout = app, max_body_bytes, body_timeout

    async def _read_within(self, receive: Any) -> bytes:
        """The whole body, or `BodyRejected(408)` once `body_timeout` seconds have passed."""
        try:
            async with asyncio.timeout(self.body_timeout):
                return await self._read(receive)
        except TimeoutError:
            raise BodyRejected(
                408, f"request body not received whole within {self.body_timeout:g} s"
            ) from None

    async def _read(self, receive: Any) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BodyRejected(400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyRejected(413, f"request body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            declared = _declared_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                raise BodyRejected(413, f"request body over {self.max_body_bytes} bytes")
            body = await self._read_within(receive)
            _check_body(body, _content_type(scope))
        except BodyRejected as exc:
            # The rest of a body refused while reading is never read: the connection closes.
            close = {"connection": "close"} if exc.status in (408, 413) else None
            await error(exc.status, str(exc), close)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
