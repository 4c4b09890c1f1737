"""Job status: NAT's status mapping (docs/customizer.md#job-status) and a status record that tolerates missing
fields (NAT crashes on a status without `percentage_done`).

Statuses use NAT's `TrainingStatusEnum` values: `pending`, `running`, `completed`, `failed`,
`canceled` (one "l"). Mapping of the service's status: created/pending -> pending; running ->
running; completed and ready -> completed (NAT maps `ready` to running and would poll forever);
failed -> failed; cancelled/canceled -> canceled; anything else (cancelling, unknown, missing) ->
running, so polling continues until the overall timeout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PENDING, RUNNING, COMPLETED, FAILED, CANCELED = (
    "pending",
    "running",
    "completed",
    "failed",
    "canceled",
)
TERMINAL = (COMPLETED, FAILED, CANCELED)
_MAP = {
    "created": PENDING,
    "pending": PENDING,
    "running": RUNNING,
    "completed": COMPLETED,
    "ready": COMPLETED,
    "failed": FAILED,
    "cancelled": CANCELED,
    "canceled": CANCELED,
}


def map_status(raw: str | None) -> str:
    """NAT's status mapping, with `ready` as completed (see the module docstring)."""
    return _MAP.get((raw or "").strip().lower(), RUNNING)


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass
class JobStatus:
    """One observation of a customization job."""

    status: str
    raw_status: str | None = None
    progress: float | None = None
    epochs_completed: int | None = None
    steps_completed: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    message: str | None = None
    reason: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_details(cls, details: Any, epochs: int | None = None) -> JobStatus:
        """Build from the SDK's status object (or a dict). A missing `percentage_done` is derived
        from `epochs_completed / epochs` when both are known, else left as None."""
        raw = _get(details, "status")
        raw = raw if isinstance(raw, str) else None
        epochs_done = _get(details, "epochs_completed")
        epochs_done = epochs_done if isinstance(epochs_done, int) else None
        progress = _number(_get(details, "percentage_done"))
        if progress is None and epochs_done is not None and epochs:
            progress = min(100.0, 100.0 * epochs_done / epochs)
        status = map_status(raw)
        reason = _reason(_get(details, "status_logs")) if status in (FAILED, CANCELED) else None
        message = f"Status: {raw or 'missing'}"
        if epochs_done is not None:
            message += f", Epochs: {epochs_done}"
        if reason:
            message += f" ({reason})"
        steps = _get(details, "steps_completed")
        return cls(
            status=status,
            raw_status=raw,
            progress=progress,
            epochs_completed=epochs_done,
            steps_completed=steps if isinstance(steps, int) else None,
            train_loss=_number(_get(details, "train_loss")),
            val_loss=_number(_get(details, "val_loss")),
            message=message,
            reason=reason,
        )


def _reason(logs: Any) -> str | None:
    """The latest status log's detail or message: the server's reason for a failure."""
    if not isinstance(logs, list) or not logs:
        return None
    last = logs[-1]
    parts = [_get(last, "message"), _get(last, "detail")]
    parts = [p for p in parts if isinstance(p, str) and p]
    return ": ".join(dict.fromkeys(parts)) or None
