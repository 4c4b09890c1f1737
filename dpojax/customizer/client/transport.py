"""Bounded retries and error classification for the three HTTP clients the submitter uses.

Every failure of the NeMo SDK, huggingface_hub or httpx is classified as
- `transient`: connection refused/reset, timeouts, HTTP 408, 429 and 5xx -> retried with
  exponential backoff, at most `max_retries` times, then `ServiceUnreachableError`;
- `conflict`: HTTP 409 -> "already exists" for create calls that allow it, otherwise retried like a
  transient failure (the SDK's own reading: a lock timeout);
- `rejected`: any other 4xx -> `RequestRejectedError` at once, with the server's message.
The SDK client is built with `max_retries=0`, so these are the only retries of SDK calls.

The backoff is `Retrier.delay`'s one line (doubling from `retry_backoff_seconds`, capped), not
tenacity's or backoff's: neither is a dependency of dpojax or of its customizer extra, and the
retry decision is this module's classification of three clients' errors (409 handled apart,
4xx never retried), which a decorator library would take as a predicate all the same.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dpojax.customizer.client.auth import Redactor
from dpojax.customizer.client.errors import RequestRejectedError, ServiceUnreachableError

log = logging.getLogger("dpojax.customizer")
T = TypeVar("T")
TRANSIENT, CONFLICT, REJECTED = "transient", "conflict", "rejected"
_MAX_MESSAGE = 600


@dataclass(frozen=True)
class Failure:
    """A classified client failure."""

    kind: str
    status: int | None
    message: str

    def describe(self) -> str:
        return f"HTTP {self.status}: {self.message}" if self.status else self.message


def server_message(body: Any, fallback: str = "") -> str:
    """The human-readable part of an error body (`detail`, `message` or `error`), shortened."""
    text = ""
    if isinstance(body, dict):
        for key in ("detail", "message", "error"):
            value = body.get(key)
            if isinstance(value, str) and value:
                text = value
                break
            if isinstance(value, list) and value:  # FastAPI/pydantic validation errors
                text = "; ".join(
                    str(v.get("msg", v)) if isinstance(v, dict) else str(v) for v in value
                )
                break
    elif isinstance(body, str):
        text = body
    text = (text or fallback).strip()
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def _kind_for_status(status: int) -> str:
    if status in (408, 429) or status >= 500:
        return TRANSIENT
    return CONFLICT if status == 409 else REJECTED


def _response_message(response: Any) -> str:
    try:
        return server_message(response.json(), response.text)
    except Exception:  # not JSON, or a streamed body
        try:
            return server_message(response.text)
        except Exception:
            return ""


def _transport_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for name in ("httpx", "httpx2"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "TransportError"):
            types.append(module.TransportError)
    return tuple(types)


def classify(exc: BaseException) -> Failure | None:
    """Classify an exception from the SDK, huggingface_hub or httpx; None if it is not one."""
    nm = sys.modules.get("nemo_microservices")
    if nm is not None:
        if isinstance(exc, nm.APIStatusError):
            message = server_message(exc.body, _response_message(exc.response))
            return Failure(_kind_for_status(exc.status_code), exc.status_code, message)
        if isinstance(exc, nm.APIConnectionError):  # includes APITimeoutError
            cause = exc.__cause__ or exc
            return Failure(TRANSIENT, None, f"{exc.message} ({type(cause).__name__}: {cause})")
    hub_errors = sys.modules.get("huggingface_hub.errors")
    if hub_errors is not None and isinstance(exc, hub_errors.HfHubHTTPError):
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        message = (
            exc.server_message or (_response_message(response) if response else "") or str(exc)
        )
        return Failure(_kind_for_status(status) if status else TRANSIENT, status, message.strip())
    for name in ("httpx", "httpx2"):
        module = sys.modules.get(name)
        if module is not None and isinstance(exc, module.HTTPStatusError):
            status = exc.response.status_code
            return Failure(_kind_for_status(status), status, _response_message(exc.response))
    if isinstance(exc, _transport_error_types()):
        return Failure(TRANSIENT, None, f"{type(exc).__name__}: {exc}")
    return None


@dataclass
class Retrier:
    """Runs one request with bounded retries (see the module docstring)."""

    max_retries: int = 3
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 8.0
    redactor: Redactor | None = None
    sleep: Callable[[float], None] = time.sleep

    def delay(self, attempt: int) -> float:
        """Backoff before retry number `attempt` (1-based)."""
        return min(self.max_backoff_seconds, self.backoff_seconds * 2 ** (attempt - 1))

    def _text(self, text: str) -> str:
        return self.redactor.text(text) if self.redactor else text

    def call(self, what: str, fn: Callable[[], T], *, conflict_ok: bool = False) -> T | None:
        """`fn()`, retried on transient failures. With `conflict_ok`, a 409 returns None."""
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except Exception as exc:
                failure = classify(exc)
                if failure is None:
                    raise
                if failure.kind == CONFLICT and conflict_ok:
                    log.info("%s: already exists (%s)", what, self._text(failure.message))
                    return None
                if failure.kind == REJECTED:
                    raise RequestRejectedError(
                        self._text(f"{what} was refused by the service: {failure.describe()}"),
                        status_code=failure.status,
                    ) from None
                if attempt < attempts:
                    wait = self.delay(attempt)
                    log.warning(
                        "%s failed (%s); retry %d/%d in %.2fs",
                        what,
                        self._text(failure.describe()),
                        attempt,
                        self.max_retries,
                        wait,
                    )
                    self.sleep(wait)
                    continue
                if failure.kind == CONFLICT:
                    raise RequestRejectedError(
                        self._text(f"{what} kept conflicting: {failure.describe()}"),
                        status_code=failure.status,
                    ) from None
                raise ServiceUnreachableError(
                    self._text(
                        f"{what}: the service could not be reached after {attempts} attempt(s): "
                        f"{failure.describe()}"
                    )
                ) from None
        raise AssertionError("unreachable")
