"""A training job's checkpoints carry content checksums and the run's id: a corrupt latest
checkpoint is refused on resume and export (or the previous one taken where asked), and one of
another run is refused."""

from __future__ import annotations

import json

import pytest

from dpojax.config import frozen
from dpojax.jobs.train import export, train
from dpojax.jobs.workdir.run_identity import RUN_FILE, OtherRunsCheckpoint
from dpojax.train.checkpoint import CheckpointCorrupt
from tests.unit.jobs.test_train_resume import _config, assets  # noqa: F401 - a fixture
from tests.unit.train.test_checkpoint import _overwrite_inside


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's readers
def test_a_corrupt_or_foreign_checkpoint_is_refused_and_the_previous_one_taken_where_asked(
    assets,  # noqa: F811 - the fixture
    tmp_path,
):
    """Before: a checkpoint with a few KiB overwritten was exported (exit 0) with whatever was
    read, and a resume hit NaN (exit 4) naming the damaged step as the last good one; a
    checkpoint of another run put in place was exported without a word."""
    config = _config(assets, steps=4)
    config.checkpoint.every_steps = 2
    work = tmp_path / "run"
    train(frozen(config), work)
    checkpoints = work / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    _overwrite_inside(checkpoints / "4")
    for run in (export, train):
        with pytest.raises(CheckpointCorrupt) as info:
            run(frozen(config), work)
        message = str(info.value)
        assert f"checkpoint step 4 in {checkpoints / '4'} fails its content checksums" in message
        assert "--config.checkpoint.on_corrupt=previous" in message

    config.checkpoint.on_corrupt = "previous"  # a run-control key: no settings change
    assert export(frozen(config), work) == work / "export"  # step 2's weights
    seen = []
    summary = train(frozen(config), work, callback=lambda *a: seen.append(a[0]))
    assert summary["status"] == "completed" and seen == [3, 4]  # resumed from step 2
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "4.corrupt"]

    run_file = work / RUN_FILE
    run_file.write_text(json.dumps({"run_id": "0123456789abcdef"}))  # as if copied in
    with pytest.raises(OtherRunsCheckpoint, match=r"was saved by another run \(run id "):
        export(frozen(config), work)
