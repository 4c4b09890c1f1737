"""Which run a workdir holds, and restores that check it: WORKDIR/run.json records a random run
id when a run starts afresh; every checkpoint the run saves carries it (in its `extra`), and
a resume, an export or an evaluation refuses a checkpoint that another run saved (one copied
in from another workdir) instead of continuing or exporting another run's weights without a
word. A checkpoint's content checksums are verified by the restore itself
(`dpojax.train.checkpoint`); `checkpoint.on_corrupt=previous` lets it go back to the newest
earlier step that verifies.

A workdir from before the record existed: its checkpoints carry no id and are accepted; a run
that resumes it records the id of its latest checkpoint, or a new one.
"""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path
from typing import Any

from dpojax.jobs.workdir import atomic_write_text
from dpojax.train.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointError
from dpojax.train.state import TrainState

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
# The key of a checkpoint's extra that holds the id of the run that saved it.
RUN_ID = "run_id"


class OtherRunsCheckpoint(CheckpointError):
    """A checkpoint in the workdir was saved by another run than the workdir's."""


def read_run_id(workdir: Path) -> str | None:
    """The run id WORKDIR/run.json records (None: no record, an unreadable one is an error)."""
    path = Path(workdir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        run_id = json.loads(path.read_text())[RUN_ID]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} is not a run record (JSON with {RUN_ID!r}): restore it, or delete it to "
            "accept the workdir's checkpoints as they are"
        ) from None
    return str(run_id)


def write_run_id(workdir: Path, run_id: str) -> None:
    atomic_write_text(Path(workdir) / RUN_FILE, json.dumps({RUN_ID: run_id}, indent=2) + "\n")


def start_run(workdir: Path, *, resuming: bool) -> str | None:
    """The run id a training run goes on with (process 0): a fresh run records a new one; a
    resumed run keeps its record (None where there is none: `settle_run_id` takes the latest
    checkpoint's)."""
    if resuming:
        return read_run_id(workdir)
    run_id = secrets.token_hex(8)
    write_run_id(workdir, run_id)
    return run_id


def check_run(recorded: str | None, extra: dict[str, Any], where: str, workdir: Path) -> None:
    """Raises `OtherRunsCheckpoint` when the checkpoint `where` (its `extra`) was saved by
    another run than the `recorded` one of `workdir` (nothing to compare when either is
    missing)."""
    saved = extra.get(RUN_ID)
    if recorded is None or saved is None or saved == recorded:
        return
    raise OtherRunsCheckpoint(
        f"{where} was saved by another run (run id {saved}) than the one {workdir} holds (run "
        f"id {recorded}, {Path(workdir) / RUN_FILE}): it was copied in from another workdir; "
        "put this run's checkpoint back, or export or resume it from the workdir it came from"
    )


def settle_run_id(recorded: str | None, extra: dict[str, Any] | None, fresh: str) -> str:
    """The run id of a resumed run: its record's, else its latest checkpoint's, else `fresh`
    (the same on every process)."""
    return recorded or (extra or {}).get(RUN_ID) or fresh


def restore_checked(
    ckpt: Checkpointer,
    template: TrainState,
    *,
    on_corrupt: str,
    recorded: str | None,
    workdir: Path,
    step: int | None = None,
) -> tuple[TrainState, dict[str, Any]]:
    """The latest checkpoint, or checkpoint `step`, restored (its checksums verified; the latest
    with `on_corrupt="previous"`: the newest earlier step that verifies) and checked to be the
    workdir's own run's."""
    try:
        state, extra = ckpt.restore(template, step, fallback=on_corrupt == "previous" and not step)
    except CheckpointCorrupt as e:
        if on_corrupt == "previous" or step:
            raise
        raise CheckpointCorrupt(
            f"{e}; or pass --config.checkpoint.on_corrupt=previous to go back to the newest "
            "earlier step that verifies"
        ) from None
    step = ckpt.restored_step
    check_run(recorded, extra, f"checkpoint step {step} in {ckpt.directory / str(step)}", workdir)
    return state, extra
