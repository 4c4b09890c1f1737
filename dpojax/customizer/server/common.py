"""Helpers shared by the local server's route modules."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

NO_RETRY = {"x-should-retry": "false"}
"""Sent with 409s so the NeMo SDK does not retry an "already exists"."""


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any):
    """An error answer readable by both clients (`detail` for the SDK, `error` for hf)."""
    body = {"detail": message, "error": message, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object body of `request`; `BadRequest` if it is not one."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


class BadRequest(Exception):
    """Malformed request body (answered with a 422)."""
