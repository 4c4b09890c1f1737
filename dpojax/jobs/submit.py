"""The submit job (`mode = "submit"`): preference pairs to a NeMo Customizer deployment."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dpojax import schema
from dpojax.config import Config
from dpojax.customizer.client import SubmitInterrupted, SubmitResult
from dpojax.customizer.client import submit as submit_pairs
from dpojax.data.pair_files import read_pairs
from dpojax.interrupts import Interrupted

log = logging.getLogger(__name__)


def submit(config: Config, workdir: str | Path) -> SubmitResult:
    """Submits the pairs of data.train_path, or, without one, pairs collected first with the
    configured workflow (`collect.workflow`; configs/customizer.py names tic-tac-toe) into
    WORKDIR/collect, with the `customizer.*` settings. SIGTERM / SIGINT end it with `SubmitInterrupted` (exit 130): before
    the job exists nothing is left to cancel; after, the job is cancelled (or the message says
    how)."""
    try:
        return _submit(config, Path(workdir))
    except Interrupted as e:  # before the job existed (after, the submission handles it)
        raise SubmitInterrupted(
            f"interrupted ({e.signal_name}) before the customization job was created: no job "
            "to cancel; rerun the same command"
        ) from None


def _submit(config: Config, workdir: Path) -> SubmitResult:
    history = None
    path = config.data.train_path
    if not path:
        from dpojax.jobs.rounds.collection import collect

        stats = collect(config, workdir / "collect")
        if stats["status"] != "completed":
            raise SubmitInterrupted(
                f"{stats['status']} while collecting pairs: nothing was sent; rerun the same "
                "command"
            )
        path = workdir / "collect" / "pairs.jsonl"
        history = json.loads((workdir / "collect" / "collection_history.json").read_text())
        log.info("collected %d pairs from %d events", stats["num_pairs"], stats["num_events"])
    pairs, summary = read_pairs(path, format=config.data.format, strict=config.data.strict)
    log.info("%s", summary)
    # the settings as keys, validated and normalised by the client ('' deployment name: None)
    settings = schema.as_dict(config.customizer)
    return submit_pairs(pairs, settings, workdir=workdir, collection_history=history)
