"""Helpers shared by the local server's route modules."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

NO_RETRY = {"x-should-retry": "false"}
"""Sent with 409s so the NeMo SDK does not retry an "already exists"."""


def error(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any):
    """An error answer readable by both clients (`detail` for the SDK, `error` for hf)."""
    body = {"detail": message, "error": message, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(errors: list[dict[str, Any]], limit: int = 5) -> str:
    """FastAPI / pydantic validation errors as one line: `where: what; ...`."""
    parts = []
    for e in errors[:limit]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    more = f"; and {len(errors) - limit} more" if len(errors) > limit else ""
    return "invalid request: " + "; ".join(parts) + more
