"""What a `loop` says about each round beyond its figures: whether the greedy answers moved (so a
round whose figures equal the previous round's says why), where the gate stands, and where the
round's time went."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dpojax.collect.gate import Gate
from dpojax.data.records import Prompt
from dpojax.jobs.phases import describe


def _key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


class AnswerLog:
    """Wraps a greedy policy and keeps the answer it gave to every prompt it was asked."""

    def __init__(self, greedy: Callable[[Sequence[Prompt]], list[str]]):
        self.greedy = greedy
        self.answers: dict[str, str] = {}

    def __call__(self, prompts: Sequence[Prompt]) -> list[str]:
        texts = self.greedy(prompts)
        self.answers.update(zip(map(_key, prompts), texts, strict=True))
        return texts


def answers_changed(previous: Mapping[str, str], current: Mapping[str, str]) -> dict[str, int]:
    """`{"changed": n, "compared": m}`: of the m prompts both evaluations asked, how many got
    another greedy answer."""
    common = [k for k in current if k in previous]
    return {
        "changed": sum(previous[k] != current[k] for k in common),
        "compared": len(common),
    }


def movement_note(
    r: int, change: Mapping[str, int] | None, same_figures: bool, train_loss: float | None
) -> str:
    """Why round `r`'s figures moved or did not, from the greedy answers' change since round
    r - 1 (None: not known, e.g. the previous round was evaluated by an earlier run; "" when
    no prompt was asked in both evaluations)."""
    if change is None:
        return "greedy answers not compared (the previous round was evaluated by an earlier run)"
    changed, compared = change["changed"], change["compared"]
    if not compared:
        return ""
    note = f"{changed} of {compared} greedy answers changed since round {r - 1}"
    if changed == 0:
        loss = f" (final train loss {train_loss:.4f})" if train_loss is not None else ""
        note += (
            f": training moved the weights{loss} but not the most likely answer to any "
            f"evaluated prompt, so every figure is round {r - 1}'s"
        )
    elif same_figures:
        note += ", with the same headline figures (answers changed between equally scored ones)"
    return note


def gate_note(gate: Gate, quality: Mapping[str, float], held: int, needed: int) -> str:
    """`gate met (held 1 of 2 rounds)` or `gate not met: optimal_move_rate 0.93 (needs >=0.95)`."""
    if not gate:
        return ""
    if gate.met(quality):
        return f"gate met (held {held} of {needed} rounds)" if needed > 1 else "gate met"
    return "gate not met: " + "; ".join(gate.unmet(quality))


def gate_stop_line(r: int, gate: Gate, needed: int) -> str:
    """`stopping after round 16: the gate (...) is met (loop.gate_rounds=1)`, or `has held for 2
    rounds` when it had to hold for several."""
    held = f"has held for {needed} rounds" if needed > 1 else "is met"
    return f"stopping after round {r}: the gate ({gate}) {held} (loop.gate_rounds={needed})"


def timing_line(r: int, record: Mapping[str, Any]) -> str:
    """`round 5 took 15.9 s (collection 1.3, ..., other 0.2 s), process CPU 27.4 s`."""
    phases = describe(record.get("phase_seconds", {}), record["seconds"])
    cpu = record.get("cpu_seconds")
    tail = f", process CPU {cpu:.1f} s" if cpu is not None else ""
    return f"round {r} took {record['seconds']:.1f} s ({phases}){tail}"
