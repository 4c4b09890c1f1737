"""Fault injection for the local Customizer server: rules matched against incoming requests.

A rule (JSON object) matches requests by `method` (`"*"` = any) and `path` (a regular expression
searched in the URL path); it lets the first `skip` matches through and then acts on the next
`times` matches (`times: -1` = forever):

- `"action": "status"`: answer `status` (default 503) with `{"detail": message, "error": message}`
  and any extra `headers`, without touching server state (a burst of 500/503, a 409 on create, ...).
- `"action": "reset"`: drop the connection before any state change (the client sees the peer close
  the connection mid-response).
- `"action": "delay"`: sleep `delay_seconds`, then handle the request normally (a slow response).

Job-level faults (how new jobs behave) live in `JobScript`: `outcome` (`completed`, `failed`,
`cancelled`), `message` (the failure reason reported in `status_logs`), `omit_percentage_done`.
Both come from the server's `--faults FILE` option or the test-only `/_admin/*` endpoints.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ACTIONS = ("status", "reset", "delay")
# The statuses a job ends in (the server's spelling); a fault script may force any of them.
TERMINAL = ("completed", "failed", "cancelled")
OUTCOMES = TERMINAL


@dataclass
class FaultRule:
    """One request-matching fault (see the module docstring)."""

    path: str
    method: str = "*"
    action: str = "status"
    status: int = 503
    message: str = "injected fault"
    headers: dict[str, str] = field(default_factory=dict)
    delay_seconds: float = 0.0
    times: int = 1
    skip: int = 0
    fired: int = 0
    seen: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        self._pattern = re.compile(self.path)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> FaultRule:
        known = {"path", "method", "action", "status", "message", "headers"}
        known |= {"delay_seconds", "times", "skip"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown fault rule keys: {sorted(unknown)}")
        return cls(**dict(raw))

    def matches(self, method: str, path: str) -> bool:
        return (self.method == "*" or self.method.upper() == method.upper()) and bool(
            self._pattern.search(path)
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "method": self.method,
            "action": self.action,
            "status": self.status,
            "message": self.message,
            "times": self.times,
            "skip": self.skip,
            "fired": self.fired,
            "seen": self.seen,
        }


@dataclass
class JobScript:
    """How newly created jobs behave (the simulate backend honours it)."""

    outcome: str = "completed"
    message: str = "training failed: injected fault"
    omit_percentage_done: bool = False
    fail_after_epochs: int = 1

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"job outcome must be one of {OUTCOMES}, got {self.outcome!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobScript:
        unknown = set(raw) - {"outcome", "message", "omit_percentage_done", "fail_after_epochs"}
        if unknown:
            raise ValueError(f"unknown job script keys: {sorted(unknown)}")
        return cls(**dict(raw))


class FaultInjector:
    """Thread-safe list of rules; `pick` returns the rule to apply to a request, if any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rules: list[FaultRule] = []
        self.job_script = JobScript()

    def configure(self, raw: Mapping[str, Any]) -> None:
        """Replace the rules and/or the job script from `{"rules": [...], "job": {...}}`."""
        unknown = set(raw) - {"rules", "job"}
        if unknown:
            raise ValueError(f"unknown fault config keys: {sorted(unknown)}")
        rules = [FaultRule.from_dict(r) for r in raw.get("rules", [])]
        script = JobScript.from_dict(raw["job"]) if "job" in raw else None
        with self._lock:
            if "rules" in raw:
                self.rules = rules
            if script is not None:
                self.job_script = script

    def clear(self) -> None:
        with self._lock:
            self.rules = []
            self.job_script = JobScript()

    def pick(self, method: str, path: str) -> FaultRule | None:
        """The first active rule matching the request (consuming one of its `times`)."""
        with self._lock:
            for rule in self.rules:
                if not rule.matches(method, path):
                    continue
                rule.seen += 1
                if rule.seen <= rule.skip:
                    continue
                if rule.times >= 0 and rule.fired >= rule.times:
                    continue
                rule.fired += 1
                return rule
        return None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rules": [r.as_dict() for r in self.rules],
                "job": vars(self.job_script).copy(),
            }
