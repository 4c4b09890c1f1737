"""The quality gate of a `loop` (`loop.gate`): conditions on the workflow's evaluation metrics
that a round meets or not, e.g. `"optimal_move_rate>=0.95,illegal_move_rate<=0,losses_total<=0"`.

Each condition is `METRIC OP NUMBER` with OP one of `>=`, `<=`, `>`, `<`, `==`; a round meets
the gate when it meets every condition. The loop records which rounds met it, when it was first
met, and stops once it has held for `loop.gate_rounds` consecutive rounds.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
_CONDITION = re.compile(
    r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|==|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


@dataclass(frozen=True, slots=True)
class Condition:
    metric: str
    op: str
    threshold: float

    def holds(self, value: float) -> bool:
        return OPERATORS[self.op](float(value), self.threshold)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


class Gate:
    """The conditions of `spec` (comma-separated; `""`: no gate). A malformed condition is a
    ValueError that names it and the accepted form."""

    def __init__(self, spec: str):
        self.conditions: list[Condition] = []
        for part in spec.split(",") if spec.strip() else []:
            match = _CONDITION.match(part)
            if match is None:
                raise ValueError(
                    f"condition {part.strip()!r} is not METRIC OP NUMBER with OP one of "
                    f"{', '.join(OPERATORS)} (e.g. 'optimal_move_rate>=0.95')"
                )
            metric, op, number = match.groups()
            self.conditions.append(Condition(metric, op, float(number)))

    def __bool__(self) -> bool:
        return bool(self.conditions)

    def __str__(self) -> str:
        return ",".join(str(c) for c in self.conditions)

    def missing(self, quality: Mapping[str, float]) -> list[str]:
        """The gate's metrics that `quality` lacks."""
        return [c.metric for c in self.conditions if quality.get(c.metric) is None]

    def unmet(self, quality: Mapping[str, float]) -> list[str]:
        """The conditions `quality` does not meet, with its values: `optimal_move_rate 0.93
        (needs >=0.95)`; a missing metric counts as unmet."""
        out = []
        for c in self.conditions:
            value = quality.get(c.metric)
            if value is None:
                out.append(f"{c.metric} missing (needs {c.op}{c.threshold:g})")
            elif not c.holds(value):
                out.append(f"{c.metric} {value:.4g} (needs {c.op}{c.threshold:g})")
        return out

    def met(self, quality: Mapping[str, float]) -> bool:
        """Whether `quality` meets every condition (a gate without conditions: never)."""
        return bool(self.conditions) and not self.unmet(quality)
