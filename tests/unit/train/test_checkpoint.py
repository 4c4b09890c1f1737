"""Checkpoints: bit-identical round trips, async saves, retention, sharded restore, SIGKILL
during a save, and clear errors for incompatible or corrupt checkpoints."""

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import add_lora, init_model
from dpojax.models.sharding import make_mesh
from dpojax.models.tiny import tiny_config
from dpojax.train.checkpoint import CheckpointCorrupt, Checkpointer, CheckpointError
from tests.helpers.checkpoint_crash import make_state
from tests.helpers.processes import run_processes
from tests.unit.train.test_step import _batch, _setup

REPO = Path(__file__).resolve().parents[3]
EXTRA = {"data": {"epoch": 1, "position": 17, "order_seed": 3}, "seed": 0, "lr": 1e-3, "x": [1, 2]}


def _saved_leaves(state):
    """Numpy copies of the saved fields (step, params, opt_state), in tree order."""
    return [np.array(x) for x in jax.tree.leaves((state.step, state.params, state.opt_state))]


def _assert_saved_fields_equal(restored, expected_leaves):
    got = jax.tree.leaves((restored.step, restored.params, restored.opt_state))
    assert len(got) == len(expected_leaves)
    for a, b in zip(got, expected_leaves, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), b)


def _step_dirs(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.slow
@pytest.mark.parametrize(("async_save", "lora"), [(False, True), (True, False)])
def test_round_trip_is_bit_identical(tmp_path, async_save, lora):
    def model_fn(seed):
        model = init_model(tiny_config("llama", vocab_size=64), seed=seed)
        return add_lora(model, rank=4, alpha=8.0, seed=1) if lora else model

    stepper, state = _setup(model_fn(0))  # the train step donates the model's arrays
    for i in range(2):  # non-trivial Adam moments and count
        state, _ = stepper.train(state, _batch(seed=i))
    expected = _saved_leaves(state)
    ckpt = Checkpointer(tmp_path, async_save=async_save)
    extra = copy.deepcopy(EXTRA)
    assert ckpt.save(2, state, extra=extra)
    # the save copied what it needs: the train step may donate and overwrite the state at once,
    # the loop may move its data iterator on
    state, _ = stepper.train(state, _batch(seed=5))
    extra["data"]["position"] += 1
    with pytest.raises(ValueError, match="extra must be JSON-serialisable"):
        ckpt.save(3, state, extra={"rng": np.zeros(2)})
    ckpt.wait()
    assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
    # only the trainable part is saved
    saved = ckpt._manager.item_metadata(2)["state"]
    assert set(saved.tree) == {"step", "params", "opt_state"}
    ckpt.close()

    _, template = _setup(model_fn(1))  # a fresh state: other weights, step 0, zero moments
    restored, extra = Checkpointer(tmp_path).restore(template)
    _assert_saved_fields_equal(restored, expected)
    assert int(restored.step) == 2
    assert extra == EXTRA
    assert restored.frozen is template.frozen and restored.ref is template.ref
    # the restored state trains on with the same jitted step
    stepper.train(restored, _batch(seed=6))
    assert stepper.train_cache_size() == 1


def test_keeps_the_last_n_and_the_best(tmp_path):
    state = make_state()
    ckpt = Checkpointer(tmp_path, max_to_keep=2, best_metric="eval_loss", best_mode="min")
    assert ckpt.best_step() is None
    metrics = {
        1: {"eval_loss": 0.5},
        2: {"eval_loss": 0.3, "eval_acc": 0.9},  # the best
        3: None,
        4: {"eval_loss": 0.9},
        5: {"train_loss": 0.1},  # no eval metric: never the best, no crash
        6: {"eval_loss": float("nan")},  # not finite: never the best
    }
    for step, m in metrics.items():
        ckpt.save(step, state, extra={"step": step}, metrics=m)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 5, 6]
    assert ckpt.best_step() == 2
    assert _step_dirs(tmp_path) == ["2", "5", "6"]
    ckpt.close()

    ckpt = Checkpointer(tmp_path, max_to_keep=2, best_metric="eval_loss", best_mode="min")
    assert ckpt.all_steps() == [2, 5, 6] and ckpt.best_step() == 2  # metrics read back from disk
    assert ckpt.restore(state, step=2)[1] == {"step": 2}
    ckpt.save(7, state, extra={"step": 7}, metrics={"eval_loss": 0.1})
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7] and ckpt.best_step() == 7
    assert not ckpt.save(7, state, extra={})  # an existing step is not saved again
    assert not ckpt.save(3, state, extra={})  # nor an older one, unless forced
    ckpt.close()

    plain = Checkpointer(tmp_path / "plain", max_to_keep=1)
    plain.save(1, state, extra={})
    plain.save(2, state, extra={}, metrics={"eval_loss": 1.0})
    plain.wait()
    assert plain.all_steps() == [2] and plain.best_step() is None
    plain.close()

    best_max = Checkpointer(tmp_path / "max", max_to_keep=1, best_metric="acc", best_mode="max")
    for step, acc in ((1, 0.9), (2, 0.5), (3, 0.7)):
        best_max.save(step, state, extra={}, metrics={"acc": acc})
    best_max.wait()
    assert best_max.all_steps() == [1, 3] and best_max.best_step() == 1
    best_max.close()


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_restore_into_a_sharded_template(tmp_path):
    state = make_state(seed=0)
    expected = _saved_leaves(state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, extra={})

    mesh = make_mesh(2, 2, 2)
    stepper, template = _setup(init_model(tiny_config("llama", vocab_size=64), seed=1), mesh=mesh)
    with Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(template)
    _assert_saved_fields_equal(restored, expected)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(template), strict=True):
        assert got.sharding == want.sharding
    kernel = restored.params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (
        32,
        88,
    )

    # and back: the sharded state saved, restored on one device from an abstract template
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, restored, extra={})
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_state())
        single, _ = ckpt.restore(abstract)
    _assert_saved_fields_equal(single, expected)
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(single.params))
    # the template's dtypes win: float32 weights restored as bfloat16
    bf16 = abstract.replace(
        params=jax.tree.map(lambda x: x.update(dtype=jnp.bfloat16), abstract.params)
    )
    with Checkpointer(tmp_path) as ckpt:
        cast, _ = ckpt.restore(bf16, step=1)
    for got, want in zip(jax.tree.leaves(cast.params), jax.tree.leaves(state.params), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["write", "commit"])
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, mode):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    helper = REPO / "tests" / "helpers" / "checkpoint_crash.py"
    proc = subprocess.run(
        [sys.executable, str(helper), str(tmp_path), mode],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    # killed mid-save: step 2 exists only as orbax's uncommitted temporary directory
    assert _step_dirs(tmp_path) == ["1", "2.orbax-checkpoint-tmp"]

    ckpt = Checkpointer(tmp_path, max_to_keep=1)
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    template = make_state(seed=5)
    restored, extra = ckpt.restore(template)
    _assert_saved_fields_equal(restored, _saved_leaves(make_state()))
    assert extra == {"step": 1}
    # the leftover is cleaned up and step 2 can be saved again (then step 1 goes: max_to_keep=1)
    assert ckpt.save(2, restored, extra={"step": 2})
    ckpt.wait()
    assert _step_dirs(tmp_path) == ["2"] and ckpt.latest_step() == 2
    ckpt.close()


@pytest.mark.slow
def test_incompatible_model_names_the_step_and_parameter(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, make_state(), extra={})
        with pytest.raises(CheckpointError) as info:
            ckpt.restore(make_state(vocab_size=128))
        message = str(info.value)
        assert f"checkpoint step 3 in {tmp_path / '3'} does not match the model" in message
        assert message.endswith("; and 3 more shape mismatches")
        assert message.index(
            "params/embed_tokens has shape (64, 64) in the checkpoint, (128, 64)"
        ) < (message.index("opt_state/"))
        with pytest.raises(
            CheckpointError,
            match=r"missing from the checkpoint: params/layers/0/self_attn/k_proj/lora_a, .*"
            r"in the checkpoint but not in the model: params/embed_tokens, ",
        ):
            ckpt.restore(make_state(lora_rank=2))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's readers
def test_missing_and_corrupt_checkpoints_are_reported(tmp_path):
    state = make_state()
    with pytest.raises(CheckpointError, match="no checkpoint to restore in"):
        Checkpointer(tmp_path / "empty").restore(state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, extra={})
        ckpt.save(2, state, extra={})
        with pytest.raises(
            CheckpointError, match=r"no checkpoint step 9 in .* \(available: \[1, 2\]\)"
        ):
            ckpt.restore(state, step=9)

    def corrupt(step):
        return rf"checkpoint step {step} in {tmp_path / str(step)} is unreadable or corrupt \("

    # array data truncated
    for f in (tmp_path / "2" / "state" / "ocdbt.process_0" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=corrupt(2) + r".*available: \[1\]"):
        Checkpointer(tmp_path).restore(state)
    # metadata garbled
    (tmp_path / "1" / "state" / "_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError, match=corrupt(1)):
        Checkpointer(tmp_path).restore(state, step=1)
    # a stray directory named like a step
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=corrupt(5)):
        Checkpointer(tmp_path).restore(state)


def test_a_signal_during_a_restore_is_no_corruption(tmp_path, monkeypatch):
    """A signal that arrives while the checkpoint library restores reaches the command as the
    interruption it is (the library wraps it into its own error), not as a corrupt step."""
    from dpojax.interrupts import Interrupted

    state = make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, extra={})
    ckpt = Checkpointer(tmp_path)

    def interrupted_restore(*args, **kwargs):
        try:
            raise Interrupted("SIGTERM")
        except Interrupted as e:
            raise RuntimeError("restore failed in a worker thread") from e

    monkeypatch.setattr(ckpt._manager, "restore", interrupted_restore)
    with pytest.raises(Interrupted):
        ckpt.restore(state)
    ckpt.close()
    assert Checkpointer(tmp_path).restore(state)[1] == {}  # the checkpoint itself is fine


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_arrays_are_written_uncompressed_unless_asked_and_both_restore(tmp_path):
    """checkpoint.compress=False (the default) writes the arrays as they are (no compressed copy
    of the state in host memory during the save); True compresses them (the fresh state's zero
    Adam moments to almost nothing). Either restores bit-identically with either setting."""
    state = make_state(seed=0)
    expected = _saved_leaves(state)
    raw = sum(x.nbytes for x in expected)
    sizes = {}
    for compress in (False, True):
        with Checkpointer(tmp_path / str(compress), compress=compress) as ckpt:
            ckpt.save(1, state, extra={})
        sizes[compress] = _bytes_under(tmp_path / str(compress) / "1")
        for reader in (False, True):
            with Checkpointer(tmp_path / str(compress), compress=reader) as ckpt:
                restored, _ = ckpt.restore(make_state(seed=1))
            _assert_saved_fields_equal(restored, expected)
    assert sizes[False] >= raw > 1.5 * sizes[True], (raw, sizes)


def _overwrite_inside(step_dir: Path, size: int = 4096) -> Path:
    """Overwrites `size` bytes in the middle of the largest array data file of a checkpoint
    (its length unchanged: bit rot, not truncation); returns the file."""
    data = max(
        (f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
        key=lambda f: f.stat().st_size,
    )
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + size] = np.random.default_rng(0).bytes(size)
    data.write_bytes(bytes(raw))
    return data


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bit_rot_in_a_data_file_is_refused_and_falls_back_where_asked(tmp_path):
    """Before: a few KiB overwritten inside a checkpoint's data file restored without a word
    (whatever was read became the weights)."""
    first, second = make_state(seed=0), make_state(seed=2)
    expected = _saved_leaves(first)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, first, extra={"n": 1})
        ckpt.save(2, second, extra={"n": 2})
    _overwrite_inside(tmp_path / "2")
    with pytest.raises(CheckpointCorrupt) as info:
        Checkpointer(tmp_path).restore(make_state(seed=1))
    message = str(info.value)
    assert f"checkpoint step 2 in {tmp_path / '2'} fails its content checksums (" in message
    assert f"the files under {tmp_path / '2' / 'state'} changed" in message
    assert "available: [1]" in message

    ckpt = Checkpointer(tmp_path)
    restored, extra = ckpt.restore(make_state(seed=1), fallback=True)
    _assert_saved_fields_equal(restored, expected)
    assert extra == {"n": 1} and ckpt.restored_step == 1 and ckpt.passed_over == [2]
    # moved aside, the step can be saved again (before, the corrupt one stayed in the way)
    assert ckpt.set_aside([2]) == [tmp_path / "2.corrupt"]
    assert ckpt.all_steps() == [1] and (tmp_path / "2.corrupt" / "state").is_dir()
    assert ckpt.save(2, second, extra={"n": 2}, force=True)
    ckpt.close()
    assert Checkpointer(tmp_path).restore(make_state(seed=1))[1] == {"n": 2}

    _overwrite_inside(tmp_path / "1")
    _overwrite_inside(tmp_path / "2")
    with pytest.raises(CheckpointCorrupt, match=r"no earlier step verifies either \(tried 2, 1\)"):
        Checkpointer(tmp_path).restore(make_state(seed=1), fallback=True)
    # an explicit step is never swapped for another
    with pytest.raises(CheckpointCorrupt, match="checkpoint step 2 in"):
        Checkpointer(tmp_path).restore(make_state(seed=1), step=2, fallback=True)


def test_an_edited_extra_is_refused_and_a_checkpoint_without_checksums_restores(
    tmp_path, monkeypatch
):
    from dpojax.train import integrity

    state = make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, extra={"data": {"position": 17}})
    metadata = tmp_path / "1" / "extra" / "metadata"
    text = metadata.read_text()
    assert '"position": 17' in text
    metadata.write_text(text.replace('"position": 17', '"position": 71'))
    with pytest.raises(CheckpointCorrupt, match=rf"\(extra\): the files under {tmp_path / '1'}"):
        Checkpointer(tmp_path).restore(state)
    with pytest.raises(ValueError, match="must not hold the key 'integrity'"):
        Checkpointer(tmp_path / "x").save(1, state, extra={"integrity": 1})
    # an earlier build's checkpoint: no record, restored as it is
    monkeypatch.setattr(integrity, "seal", lambda extra, flat: extra)
    with Checkpointer(tmp_path / "old") as ckpt:
        ckpt.save(1, state, extra={"n": 1})
    assert Checkpointer(tmp_path / "old").restore(state)[1] == {"n": 1}


@pytest.mark.slow
@pytest.mark.exclusive  # 2 processes
def test_two_processes_record_every_shard_and_refuse_a_damaged_one_together(tmp_path):
    """2 processes x 2 CPU devices, arrays sharded over the processes. Before: the record held no
    array checksums (`"arrays": null`) and the arrays restored unchecked. Now each process hashes
    its own shards; a few bytes overwritten in one data file are refused by both processes with
    one message (one process finds the damage: were it to raise alone, the other would wait)."""
    helper = REPO / "tests" / "helpers" / "checkpoint_processes.py"
    results = run_processes(helper, str(tmp_path))
    print("seal (s, first and second save):", [r["seal_s"] for r in results])
    # w: 4 shards, b: 2 (replicated over data), step: 1
    assert [(r["format"], r["shards"]) for r in results] == [(2, 7)] * 2
    message = results[0]["refused"]
    assert message and message == results[1]["refused"]
    assert f"checkpoint step 1 in {tmp_path / '1'} fails its content checksums (params/" in message
