"""Weights & Biases (offline mode) and MLflow (a local file store) behind MetricsWriter: the
metrics of a short run land in both, under `<split>/<name>` at their steps; a resumed run
continues the same tracker runs. Nothing leaves the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpojax.train.metrics_io import MetricsWriter, read_metrics
from dpojax.train.tracking import (
    STATE_FILE,
    WANDB_HEADER,
    TrackerError,
    flat_config,
    make_sinks,
    parse_report_to,
    wandb_records,
)


@pytest.fixture
def offline_trackers(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    return monkeypatch


def wandb_history(run_dir: Path) -> list[dict]:
    """The logged rows of an offline W&B run, read from its `.wandb` file
    (`tracking.wandb_records`)."""
    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == WANDB_HEADER
    return [
        {
            (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
            for item in record.history.item
        }
        for record in wandb_records(data)
        if record.WhichOneof("record_type") == "history"
    ]


def _run(workdir: Path, steps: range, resume_step: int | None = None) -> None:
    sinks = make_sinks(
        ("wandb", "mlflow"),
        workdir,
        project="tests",
        run_name="short",
        config={"loss": {"beta": 0.1}, "optim": {"learning_rate": 1e-6}},
    )
    with MetricsWriter(workdir, resume_step=resume_step, sinks=sinks) as writer:
        for step in steps:
            writer.write(step, {"loss": 1.0 / step, "rewards/accuracies": 0.5}, split="train")
        writer.write(steps[-1], {"loss": 0.25}, split="eval")


@pytest.mark.slow
def test_wandb_offline_and_mlflow_file_store_record_a_short_run(tmp_path, offline_trackers):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    _run(tmp_path, range(1, 4))
    assert "MLFLOW_ALLOW_FILE_STORE" not in __import__("os").environ  # the opt-in was scoped
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert set(state) == {"wandb", "mlflow"}
    # W&B: one offline run holding every logged value
    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{state['wandb']}")
    history = wandb_history(run_dir)
    train = [(r["_step"], r["train/loss"]) for r in history if "train/loss" in r]
    assert train == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [r["eval/loss"] for r in history if "eval/loss" in r] == [0.25]
    # MLflow: the file store in WORKDIR/mlruns, the config as parameters
    offline_trackers.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store back here
    client = MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(state["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "short"
    assert run.data.params == {"loss.beta": "0.1", "optim.learning_rate": "1e-06"}
    history = client.get_metric_history(state["mlflow"], "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert run.data.metrics["eval/loss"] == 0.25
    assert run.data.metrics["train/rewards/accuracies"] == 0.5
    # metrics.jsonl is written as always
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 3]

    # a resumed run continues both runs
    _run(tmp_path, range(3, 5), resume_step=2)
    assert json.loads((tmp_path / STATE_FILE).read_text()) == state
    history = client.get_metric_history(state["mlflow"], "train/loss")
    assert [m.step for m in history] == [1, 2, 3, 3, 4]  # MLflow keeps the replaced step too
    # W&B: the same run id again, a folder per start (named to the second: a start within the
    # same second gets a "-1" suffix), the second ending with the resumed steps
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{state['wandb']}*"))
    assert len(runs) == 2
    ends = [[r["_step"] for r in wandb_history(d) if "train/loss" in r][-2:] for d in runs]
    assert [3, 4] in ends, ends


@pytest.mark.slow
def test_wandb_sink_close_returns_with_the_offline_log_on_disk(tmp_path, offline_trackers):
    """wandb-core writes an offline run's `.wandb` file out when it closes the run's stream, on a
    finish notice that `wandb.Run.finish()` sends without waiting: held back here (as a loaded
    machine can), the file is still the bare header when `finish()` returns. The sink's close
    waits for the log's exit record, so the steps are on disk when it returns."""
    pytest.importorskip("wandb")
    service_connection = pytest.importorskip("wandb.sdk.lib.service.service_connection")
    connection = getattr(service_connection, "ServiceConnection", None)
    if connection is None or not hasattr(connection, "inform_finish"):
        pytest.skip("this wandb has no ServiceConnection.inform_finish to hold back")
    import threading

    real_inform_finish = connection.inform_finish
    timers = []

    def late_inform_finish(self, run_id):
        timers.append(threading.Timer(1.0, real_inform_finish, (self, run_id)))
        timers[-1].start()

    offline_trackers.setattr(connection, "inform_finish", late_inform_finish)
    (sink,) = make_sinks(("wandb",), tmp_path, project="tests", run_name="late")
    try:
        for step in (1, 2, 3):
            sink.write(step, {"loss": 1.0 / step}, split="train")
    finally:
        sink.close()
    try:
        assert timers, "the finish notice was not held back"
        (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
        steps = [r["_step"] for r in wandb_history(run_dir) if "train/loss" in r]
        assert steps == [1, 2, 3]
    finally:
        for timer in timers:
            timer.join()


def test_report_to_names():
    assert parse_report_to("tensorboard") == ("tensorboard",)
    assert parse_report_to(" TensorBoard , wandb,mlflow,wandb") == (
        "tensorboard",
        "wandb",
        "mlflow",
    )
    assert parse_report_to("none") == parse_report_to("") == ()
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) \['comet'\]"):
        parse_report_to("tensorboard,comet")
    assert flat_config({"a": {"b": 1, "c": {"d": "x"}}, "e": 2}) == {"a.b": 1, "a.c.d": "x", "e": 2}


def test_missing_tracker_package_is_one_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("mlflow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(TrackerError, match=r"pip install 'dpojax\[wandb\]'"):
        make_sinks(("wandb",), tmp_path)
    with pytest.raises(TrackerError, match=r"pip install 'dpojax\[mlflow\]'"):
        make_sinks(("mlflow",), tmp_path)


def test_tensorboard_off_writes_no_events(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    assert read_metrics(tmp_path)[0]["loss"] == 1.0
