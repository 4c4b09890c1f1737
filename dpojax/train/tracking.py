"""Metric sinks behind `MetricsWriter`, one registry (`SINKS`): TensorBoard
(`dpojax.train.metrics_io.TensorBoardSink`), Weights & Biases and MLflow (optional extras,
`pip install "dpojax[wandb]"` / `"dpojax[mlflow]"`). A new tracker is one class with `write` and
`close` and one entry in `SINKS`.

`train.report_to` names where metrics go besides `metrics.jsonl` (always written; report.md is
drawn from it): any of `tensorboard`, `wandb`, `mlflow`, comma-separated, or `none`. Each tracker
is a sink with `write(step, values, split)` and `close()`; values are logged as `<split>/<name>`
(`train/loss`, `eval/rewards/accuracies`) at the optimizer step.

- **wandb**: `wandb.init(project=train.project, name=train.run_name, dir=WORKDIR, config=...)`;
  `WANDB_MODE=offline` (or `disabled`), `WANDB_API_KEY`, `WANDB_ENTITY`, ... apply as usual. The
  run id is kept in `WORKDIR/tracking.json`, so a resumed run continues the same W&B run. An
  offline run's `.wandb` file is complete when the sink closes (`WandbSink.close` waits for it).
- **mlflow**: the tracking server or database of `MLFLOW_TRACKING_URI`, else a local file store
  in `WORKDIR/mlruns` (MLflow 3 keeps that store in maintenance mode and wants an opt-in,
  `MLFLOW_ALLOW_FILE_STORE`, which dpojax gives for its own default store only); experiment
  `train.project`, the config as parameters, the run id kept in `WORKDIR/tracking.json` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from dpojax.errors import EXIT_CONFIG, DpojaxError
from dpojax.train.metrics_io import TensorBoardSink

logger = logging.getLogger(__name__)

STATE_FILE = "tracking.json"
_MAX_PARAM = 500  # characters of a config value logged as an MLflow parameter


class TrackerError(DpojaxError, RuntimeError):
    """A tracker that cannot be used (not installed, misconfigured); the message says what to do."""

    exit_code = EXIT_CONFIG  # an unusable tracker is a config problem


class Sink(Protocol):
    def write(self, step: int, values: Mapping[str, float], split: str) -> None: ...

    def close(self) -> None: ...


def parse_report_to(value: str) -> tuple[str, ...]:
    """`"tensorboard,wandb"` -> ("tensorboard", "wandb"); "none" or "" -> (); ValueError for an
    unknown name."""
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"unknown tracker(s) {unknown}; choose from {', '.join(TRACKERS)} (or none)"
        )
    return tuple(dict.fromkeys(names))


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {"optim.learning_rate": 5e-07, ...}."""
    out = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[prefix + str(key)] = value
    return out


def _state(workdir: Path) -> dict[str, Any]:
    try:
        return json.loads((workdir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _remember(workdir: Path, key: str, value: str) -> None:
    state = _state(workdir)
    state[key] = value
    (workdir / STATE_FILE).write_text(json.dumps(state, indent=2))


def _tagged(values: Mapping[str, float], split: str) -> dict[str, float]:
    return {f"{split}/{k}": float(v) for k, v in values.items()}


class WandbSink:
    """Metrics of one run to Weights & Biases."""

    def __init__(self, workdir: Path, *, project: str, run_name: str, config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError:
            raise TrackerError(
                "train.report_to names wandb but it is not installed: pip install 'dpojax[wandb]'"
            ) from None
        run_id = _state(workdir).get("wandb") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(workdir),
            config=dict(config),
            reinit="create_new",
        )
        _remember(workdir, "wandb", run_id)

    def write(self, step: int, values: Mapping[str, float], split: str) -> None:
        self.run.log(_tagged(values, split), step=step)

    def close(self) -> None:
        self.run.finish()
        if self.run.offline:
            _await_exit_record(Path(self.run.settings.sync_file))


_WANDB_EXIT_WAIT_S = 30.0


WANDB_HEADER = b":W&B"  # the first 4 of a transaction log's 7 header bytes


def wandb_records(data: bytes) -> Iterator[Any]:
    """The protobuf `Record`s of the bytes of W&B's transaction log (a `.wandb` file): after the
    7-byte header, LevelDB-style log blocks of 32 KiB whose chunks (full, or first / middle /
    last of a record) are re-assembled. Stops at a record that does not parse yet (one still
    being written)."""
    from wandb.proto import wandb_internal_pb2 as pb

    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: too short for a chunk header
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:  # zero padding: the rest of the block is empty
            pos += block - pos % block
            continue
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = payload if kind in (1, 2) else pending + payload  # full/first, else middle/last
        if kind in (1, 4):
            record = pb.Record()
            try:
                record.ParseFromString(pending)
            except Exception:  # noqa: BLE001 - a record still being written
                return
            yield record


def _has_exit_record(path: Path) -> bool | None:
    """Whether W&B's transaction log at `path` holds the run's exit record (`wandb_records`);
    None when the file is not such a log (nothing to wait for)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if len(data) < 7:
        return False
    if data[:4] != WANDB_HEADER:
        return None
    return any(r.WhichOneof("record_type") == "exit" for r in wandb_records(data))


def _await_exit_record(path: Path, timeout_s: float = _WANDB_EXIT_WAIT_S) -> None:
    """Wait until an offline run's transaction log is on disk. `wandb.Run.finish()` returns once
    wandb-core has handled the exit record, but wandb-core buffers the log in 32 KiB blocks and
    writes the rest out only when it closes the run's stream, on a finish notice it is sent and
    not waited for: a reader right after `finish()` (`wandb sync`, a test) can find the header
    alone. Polls (bounded) for the exit record; warns if it never comes."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        done = _has_exit_record(path)
        if done is None or done:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "W&B's offline log %s has no exit record %g s after the run finished",
                path,
                timeout_s,
            )
            return
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is set: allow it while the
    client for dpojax's default store is built (the user's own setting is left alone)."""
    if not uri.startswith("file:") or "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)


class MlflowSink:
    """Metrics (and the config as parameters) of one run to MLflow, through its client API
    (no global active run)."""

    def __init__(self, workdir: Path, *, project: str, run_name: str, config: Mapping[str, Any]):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise TrackerError(
                "train.report_to names mlflow but it is not installed: pip install 'dpojax[mlflow]'"
            ) from None
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (workdir / "mlruns").resolve().as_uri()
        with _file_store_allowed(uri):
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(project)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = _state(workdir).get("mlflow")
        if self.run_id is None:
            run = self.client.create_run(exp_id, run_name=run_name)
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:_MAX_PARAM]) for k, v in sorted(config.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            _remember(workdir, "mlflow", self.run_id)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.uri = uri

    def write(self, step: int, values: Mapping[str, float], split: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _tagged(values, split).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@dataclasses.dataclass(frozen=True)
class SinkSettings:
    """What a sink may need of the run: the tracker project and run name, the flat config, and
    the step a resumed run restarts from."""

    project: str = "dpojax"
    run_name: str = ""
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resume_step: int | None = None


def _tensorboard(workdir: Path, s: SinkSettings) -> Sink:
    return TensorBoardSink(workdir, resume_step=s.resume_step)


def _wandb(workdir: Path, s: SinkSettings) -> Sink:
    return WandbSink(workdir, project=s.project, run_name=s.run_name, config=s.config)


def _mlflow(workdir: Path, s: SinkSettings) -> Sink:
    return MlflowSink(workdir, project=s.project, run_name=s.run_name, config=s.config)


# train.report_to name -> how its sink is made
SINKS: dict[str, Callable[[Path, SinkSettings], Sink]] = {
    "tensorboard": _tensorboard,
    "wandb": _wandb,
    "mlflow": _mlflow,
}
TRACKERS = tuple(SINKS)


def make_sinks(
    names: tuple[str, ...],
    workdir: str | os.PathLike,
    *,
    project: str = "dpojax",
    run_name: str = "",
    config: Mapping[str, Any] | None = None,
    resume_step: int | None = None,
) -> list[Sink]:
    """The sinks of `names` (`SINKS`), in that order."""
    workdir = Path(workdir)
    settings = SinkSettings(
        project=project or "dpojax",
        run_name=run_name or workdir.resolve().name,
        config=flat_config(config or {}),
        resume_step=resume_step,
    )
    return [SINKS[name](workdir, settings) for name in names]
