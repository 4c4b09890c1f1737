"""The run a workdir holds: recorded at a fresh start, carried by every checkpoint, checked
before a checkpoint is resumed, exported or evaluated."""

import json

import pytest

from dpojax.jobs.workdir.run_identity import (
    RUN_FILE,
    OtherRunsCheckpoint,
    read_run_id,
    restore_checked,
    settle_run_id,
    start_run,
)
from dpojax.train.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointError
from tests.helpers.checkpoint_crash import make_state
from tests.unit.train.test_checkpoint import _overwrite_inside


def test_a_fresh_run_records_an_id_and_a_resumed_one_keeps_it(tmp_path):
    assert start_run(tmp_path, resuming=True) is None  # an earlier build's workdir: no record
    first = start_run(tmp_path, resuming=False)
    assert json.loads((tmp_path / RUN_FILE).read_text()) == {"run_id": first}
    assert start_run(tmp_path, resuming=True) == first == read_run_id(tmp_path)
    assert start_run(tmp_path, resuming=False) != first  # a fresh run in the same workdir
    assert settle_run_id(None, {"run_id": "c"}, "new") == "c"
    assert settle_run_id(None, {}, "new") == "new" and settle_run_id("r", {}, "new") == "r"
    (tmp_path / RUN_FILE).write_text("{oops")
    with pytest.raises(CheckpointError, match=f"{tmp_path / RUN_FILE} is not a run record"):
        read_run_id(tmp_path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_of_another_run_is_refused_and_corruption_names_the_option(tmp_path):
    """Before: a checkpoint copied in from another run was exported without a word."""
    state = make_state()
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        ckpt.save(4, state, extra={"step": 4, "run_id": "other"})
    ckpt = Checkpointer(tmp_path / "checkpoints")

    def restore(recorded, on_corrupt="stop"):
        return restore_checked(
            ckpt, state, on_corrupt=on_corrupt, recorded=recorded, workdir=tmp_path
        )

    with pytest.raises(OtherRunsCheckpoint) as info:
        restore("mine")
    message = str(info.value)
    assert (
        f"checkpoint step 4 in {tmp_path / 'checkpoints' / '4'} was saved by another run "
        in message
    )
    assert "(run id other)" in message and f"(run id mine, {tmp_path / RUN_FILE})" in message
    assert restore("other")[1]["step"] == 4
    assert restore(None)[1]["step"] == 4  # no record to compare with
    assert isinstance(OtherRunsCheckpoint("x"), CheckpointError)  # exit 3

    _overwrite_inside(tmp_path / "checkpoints" / "4")
    with pytest.raises(CheckpointCorrupt, match="pass --config.checkpoint.on_corrupt=previous"):
        restore("other")
    with pytest.raises(CheckpointCorrupt, match="no checkpoint step|fails its content") as info:
        restore("other", on_corrupt="previous")
    assert "on_corrupt=previous" not in str(info.value)
    ckpt.close()
