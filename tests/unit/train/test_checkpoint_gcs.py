"""Checkpoints written by orbax straight to a gs:// URL (a GCS emulator on 127.0.0.1): the round
trip, retention and the best step, a corrupt step refused and set aside, a leftover of an
unfinished save ignored, all in the bucket."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dpojax.train.checkpoint import CheckpointCorrupt, Checkpointer
from tests.helpers.checkpoint_crash import make_state
from tests.helpers.gcs_emulator import gcs_bucket  # noqa: F401 - the fixture


def _leaves(state) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves((state.step, state.params, state.opt_state))]


def _steps(gcs_bucket, folder: str) -> set[str]:  # noqa: F811
    return {name.split("/")[0] for name in gcs_bucket.files(folder)}


def test_checkpoints_round_trip_in_the_bucket(gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/run/checkpoints"
    first, second = make_state(seed=0), make_state(seed=2)
    ckpt = Checkpointer(url, max_to_keep=1, best_metric="eval_loss")
    assert str(ckpt.directory) == url and ckpt.latest_step() is None
    for step, state, loss in ((1, first, 0.2), (2, second, 0.5), (3, second, 0.9)):
        assert ckpt.save(step, state, extra={"n": step}, metrics={"eval_loss": loss})
    ckpt.close()
    files = gcs_bucket.files("run/checkpoints")
    # orbax's own layout, committed with its GCS marker; retention dropped step 2
    assert _steps(gcs_bucket, "run/checkpoints") == {"1", "3"}
    assert {"3/commit_success.txt", "3/extra/metadata", "3/state/_METADATA"} <= files.keys()

    ckpt = Checkpointer(url, max_to_keep=1, best_metric="eval_loss")
    assert ckpt.all_steps() == [1, 3] and ckpt.latest_step() == 3 and ckpt.best_step() == 1
    restored, extra = ckpt.restore(make_state(seed=1), step=1)
    assert extra == {"n": 1}
    for a, b in zip(_leaves(restored), _leaves(first), strict=True):
        np.testing.assert_array_equal(a, b)
    ckpt.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_step_in_the_bucket_is_refused_and_set_aside(gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/run/checkpoints"
    with Checkpointer(url) as ckpt:
        ckpt.save(1, make_state(seed=0), extra={"n": 1})
        ckpt.save(2, make_state(seed=2), extra={"n": 2})
    # bit rot in step 2's largest array file, its length unchanged
    root = f"{gcs_bucket.bucket}/run/checkpoints/2/state"
    data = max(
        (n for n in gcs_bucket.fs.find(root) if "/d/" in n), key=lambda n: gcs_bucket.fs.size(n)
    )
    raw = bytearray(gcs_bucket.fs.cat_file(data))
    raw[len(raw) // 2 : len(raw) // 2 + 4096] = np.random.default_rng(0).bytes(4096)
    gcs_bucket.fs.pipe_file(data, bytes(raw))
    # an unfinished save's leftover: no commit marker, so no step
    gcs_bucket.fs.pipe_file(f"{gcs_bucket.bucket}/run/checkpoints/5/state/_METADATA", b"{}")

    ckpt = Checkpointer(url)
    assert ckpt.all_steps() == [1, 2]
    with pytest.raises(CheckpointCorrupt, match=f"checkpoint step 2 in {url}/2 fails its content"):
        ckpt.restore(make_state(seed=1))
    restored, extra = ckpt.restore(make_state(seed=1), fallback=True)
    assert extra == {"n": 1} and ckpt.passed_over == [2]
    assert [str(p) for p in ckpt.set_aside([2])] == [f"{url}/2.corrupt"]
    assert ckpt.all_steps() == [1]
    assert {"2.corrupt", "1"} <= _steps(gcs_bucket, "run/checkpoints")
    assert "2" not in _steps(gcs_bucket, "run/checkpoints")
    assert ckpt.save(2, make_state(seed=2), extra={"n": 2}, force=True)  # the step saved again
    ckpt.close()
    assert Checkpointer(url).restore(make_state(seed=1))[1] == {"n": 2}


def test_steps_saved_locally_and_uploaded_restore_from_the_bucket(gcs_bucket, tmp_path):  # noqa: F811
    state = make_state(seed=3)
    with Checkpointer(tmp_path / "checkpoints") as local:
        local.save(4, state, extra={"n": 4})
    gcs_bucket.fs.put(
        str(tmp_path / "checkpoints"), f"{gcs_bucket.bucket}/old/checkpoints", recursive=True
    )
    assert "checkpoints/4/commit_success.txt" in gcs_bucket.files("old")
    ckpt = Checkpointer(f"gs://{gcs_bucket.bucket}/old/checkpoints")
    assert ckpt.all_steps() == [4]
    restored, extra = ckpt.restore(make_state(seed=1))
    assert extra == {"n": 4}
    for a, b in zip(_leaves(restored), _leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    ckpt.close()
