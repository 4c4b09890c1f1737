"""The submit job (`mode = "submit"`): preference pairs to a NeMo Customizer deployment."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import ml_collections

from dpojax.customizer.client import SubmitResult
from dpojax.customizer.client import submit as submit_pairs
from dpojax.data.pair_files import read_pairs

log = logging.getLogger(__name__)


def submit(config: ml_collections.ConfigDict, workdir: str | Path) -> SubmitResult:
    """Submits the pairs of data.train_path, or, without one, pairs collected first with the
    configured workflow (the built-in tic-tac-toe by default) into WORKDIR/collect, with the
    `customizer.*` settings."""
    workdir = Path(workdir)
    history = None
    path = config.data.train_path
    if not path:
        from dpojax.jobs.rounds import collect

        stats = collect(config, workdir / "collect")
        path = workdir / "collect" / "pairs.jsonl"
        history = json.loads((workdir / "collect" / "collection_history.json").read_text())
        log.info("collected %d pairs from %d events", stats["num_pairs"], stats["num_events"])
    pairs, summary = read_pairs(path, format=config.data.format, strict=config.data.strict)
    log.info("%s", summary)
    return submit_pairs(pairs, config.customizer, workdir=workdir, collection_history=history)
