"""What a `loop` run keeps in WORKDIR/loop_state.json so that a re-run continues it: the initial
evaluation, each round's collection statistics and finished record, NAT's progress history, the
best round and the wall-clock time spent so far. The file is replaced whole after each phase
(collection, training + evaluation of a round), so a kill at any point leaves the state of the
last finished phase, and a re-run redoes at most the phase that was cut short
(README.md#interruptions-and-restarts)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpojax.jobs.workdir import atomic_write_text

STATE_FILE = "loop_state.json"
STATE_VERSION = 1
# Under round_NN/ once the round is done: what only its training needed (kept with
# loop.keep_round_files=True). The round's export goes too unless it is the best round or the
# policy the next round starts from.
ROUND_SCRATCH = ("train/checkpoints", "train/token_cache", "train/reference_cache")
ROUND_SCRATCH_FILES = ("train_pairs.jsonl",)


@dataclass
class LoopState:
    """The persisted progress of a loop (see the module docstring)."""

    initial: dict[str, float] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)  # finished rounds, round 0 first
    collected: dict[str, dict[str, Any]] = field(default_factory=dict)  # "r" -> stats
    history: list[dict[str, Any]] = field(default_factory=list)  # NAT's progress lines
    best_round: int = 0
    best_value: list[float] | None = None
    elapsed_seconds: float = 0.0  # wall time of every run so far, as of the last save
    round_started: dict[str, float] = field(default_factory=dict)  # "r" -> elapsed at its start
    version: int = STATE_VERSION

    @classmethod
    def load(cls, workdir: Path) -> LoopState | None:
        path = workdir / STATE_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        if raw.get("version") != STATE_VERSION:
            raise ValueError(
                f"{path} was written by another version of dpojax; start afresh with another "
                f"--workdir (or delete {workdir})"
            )
        return cls(**raw)

    def save(self, workdir: Path) -> None:
        atomic_write_text(workdir / STATE_FILE, json.dumps(asdict(self), indent=2, default=str))

    def finished(self, r: int) -> dict[str, Any] | None:
        return next((x for x in self.rounds if x["round"] == r), None)

    def model_of(self, r: int, initial: Path) -> Path:
        """The policy a finished round `r` exported (round 0: the initial model)."""
        record = self.finished(r)
        return Path(record["model"]) if r and record else initial


def write_progress_files(workdir: Path, history: list[dict[str, Any]]) -> None:
    """NAT's data_collection_progress.jsonl and collection_history.json, rewritten from the
    history (so a re-run never repeats a line)."""
    lines = "".join(json.dumps(line) + "\n" for line in history)
    atomic_write_text(workdir / "data_collection_progress.jsonl", lines)
    atomic_write_text(workdir / "collection_history.json", json.dumps(history, indent=2))


def prune_rounds(workdir: Path, state: LoopState, keep: set[int]) -> None:
    """Deletes what finished rounds no longer need (ROUND_SCRATCH*), and the exports of rounds
    not in `keep`."""
    for record in state.rounds:
        r = record["round"]
        if not r:
            continue
        round_dir = workdir / f"round_{r:02d}"
        for name in ROUND_SCRATCH:
            shutil.rmtree(round_dir / name, ignore_errors=True)
        for name in ROUND_SCRATCH_FILES:
            (round_dir / name).unlink(missing_ok=True)
        if r not in keep:
            shutil.rmtree(round_dir / "train" / "export", ignore_errors=True)
