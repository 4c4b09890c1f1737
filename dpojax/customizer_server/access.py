"""Who may use the local server: its bearer token, and where it may listen without one
(docs/customizer.md#access).

- The token comes from `--token-file PATH` (the file's text, stripped) or the
  `DPOJAX_SERVER_TOKEN` environment variable; giving both is refused, as is a token shorter
  than `MIN_TOKEN_CHARS` or with characters an HTTP header cannot carry.
- With a token, every request but the health probes must carry `Authorization: Bearer <token>`;
  `TokenAuth` answers any other with 401 and a JSON error body (`{"detail", "error"}`), comparing
  in constant time (`hmac.compare_digest`).
- Without a token the server only listens on a loopback address (`check_listen`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpojax.customizer_server.common import error

TOKEN_ENV = "DPOJAX_SERVER_TOKEN"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
OPEN_PATHS = frozenset({"/health", "/v1/health/live", "/v1/health/ready"})
_TOKEN_CHARS = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what a header value carries intact


class AccessError(ValueError):
    """A token or listen address the server refuses to start with."""


def check_token(token: str, where: str) -> str:
    """`token` if usable; `AccessError` naming `where` it came from otherwise."""
    if len(token) < MIN_TOKEN_CHARS:
        raise AccessError(
            f"{where}: the server token has {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
        )
    if len(token) > MAX_TOKEN_CHARS or not _TOKEN_CHARS.fullmatch(token):
        raise AccessError(
            f"{where}: the server token must be at most {MAX_TOKEN_CHARS} visible ASCII "
            "characters (no spaces)"
        )
    return token


def resolve_server_token(
    token_file: str | Path | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The token of `--token-file` or `$DPOJAX_SERVER_TOKEN` (None when neither is set)."""
    env = os.environ if environ is None else environ
    from_env = env.get(TOKEN_ENV, "").strip()
    if token_file is None:
        return check_token(from_env, TOKEN_ENV) if from_env else None
    if from_env:
        raise AccessError(f"both --token-file and {TOKEN_ENV} are set; give the token one way only")
    try:
        text = Path(token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AccessError(f"--token-file {token_file}: cannot read it ({exc})") from None
    if not text:
        raise AccessError(f"--token-file {token_file}: the file is empty")
    return check_token(text, f"--token-file {token_file}")


def is_loopback_host(host: str) -> bool:
    """True for `localhost` and loopback addresses; False for every other name or address
    (`0.0.0.0`, `::`, `""` and host names listen beyond this machine, or may)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_listen(host: str, token: str | None) -> None:
    """`AccessError` when the server would listen beyond loopback without a token."""
    if token is None and not is_loopback_host(host):
        raise AccessError(
            f"refusing to listen on {host!r} without a token: anyone who can reach the port "
            f"could upload files and start training. Set {TOKEN_ENV} or pass --token-file PATH "
            "(clients send it as `Authorization: Bearer <token>`; dpojax's submitter sends "
            "customizer.hf_token), or listen on 127.0.0.1"
        )


def bearer_matches(headers: list[tuple[bytes, bytes]], token: bytes) -> bool:
    """Whether the request's (first) `Authorization` header is `Bearer <token>`, compared in
    constant time."""
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, given = value.strip().partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)
    return False


class TokenAuth:
    """ASGI middleware: 401 for every request without the bearer token (health probes pass)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token.encode("ascii")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if bearer_matches(scope.get("headers", []), self.token):
            await self.app(scope, receive, send)
            return
        has_header = any(k.lower() == b"authorization" for k, _ in scope.get("headers", []))
        message = (
            "invalid token: the Authorization header does not carry this server's token"
            if has_header
            else "missing token: send `Authorization: Bearer <token>` (the server's "
            f"--token-file or {TOKEN_ENV})"
        )
        headers = {"www-authenticate": 'Bearer realm="dpojax"', "connection": "close"}
        await error(401, message, headers)(scope, receive, send)
