"""Tokens: where they come from, how they are kept out of logs and files, when to warn.

- The token is `customizer.hf_token` when set, else the `HF_TOKEN` environment variable
  (what huggingface_hub users expect), else none. It goes as `Authorization: Bearer <token>` to
  both hosts: the Datastore (as in NAT) and the Entity Store / Customizer (NAT sends none there;
  the local server, started with a token, needs it on every call). With none, no
  `Authorization` header is sent at all (NAT sends `Bearer ` with nothing after it, which httpx
  rejects) and huggingface_hub is told not to fall back to a token cached on the machine.
- `Redactor` replaces every known secret with `***` in text and nested JSON-like values; its
  `logging.Filter` form redacts records on the handlers it is attached to.
- `plain_http_warning` says when a token would travel over plain http to a non-loopback host.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

MASK = "***"
HF_TOKEN_ENV = "HF_TOKEN"
_MIN_SECRET_LEN = 4  # shorter strings would mask ordinary words


def resolve_hf_token(configured: str = "", environ: dict[str, str] | None = None) -> str | None:
    """`configured` if non-empty, else `$HF_TOKEN` if non-empty, else None."""
    if configured and configured.strip():
        return configured.strip()
    env = os.environ if environ is None else environ
    value = env.get(HF_TOKEN_ENV, "").strip()
    return value or None


def bearer_headers(token: str | None) -> dict[str, str]:
    """`{"Authorization": "Bearer <token>"}`, or no header at all without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(url: str) -> bool:
    """True when the URL's host is localhost or a loopback address."""
    host = (urlparse(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plain_http_warning(url: str, token: str | None) -> str | None:
    """A warning text when `token` is set and `url` is plain http to a non-loopback host."""
    if not token or urlparse(url).scheme != "http" or is_loopback(url):
        return None
    host = urlparse(url).netloc
    return (
        f"the token will be sent over plain http to {host}, where anyone on the network path "
        "can read it; use an https:// address"
    )


class Redactor(logging.Filter):
    """Masks known secrets in strings, nested values and log records."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        self._secrets: list[str] = []
        for s in secrets:
            self.add(s)

    def add(self, secret: str | None) -> None:
        """Register one more secret (empty or very short values are ignored)."""
        if secret and len(secret) >= _MIN_SECRET_LEN and secret not in self._secrets:
            self._secrets.append(secret)
            self._secrets.sort(key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def text(self, value: str) -> str:
        """`value` with every secret replaced by `***`."""
        for s in self._secrets:
            if s in value:
                value = value.replace(s, MASK)
        return value

    def value(self, obj: Any) -> Any:
        """A copy of a JSON-like value (dicts, lists, strings) with secrets masked."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {self.value(k): self.value(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.value(v) for v in obj]
        return obj

    def filter(self, record: logging.LogRecord) -> bool:
        """Render the record's message once, masked, so handlers never see the raw secret."""
        if self._secrets:
            try:
                message = record.getMessage()
            except Exception:  # a broken format string: leave the record to logging's own report
                return True
            record.msg, record.args = self.text(message), None
            if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
                record.exc_text = self.text(logging.Formatter().formatException(record.exc_info))
            elif record.exc_text:
                record.exc_text = self.text(record.exc_text)
        return True
