"""Training metrics on disk: `WORKDIR/metrics.jsonl` and TensorBoard event files.

The TensorBoard event format is written directly (length-prefixed records with masked CRC32C
checksums, each holding a serialized `tensorflow.Event` protocol buffer with scalar summaries), so
no TensorBoard, TensorFlow or PyTorch import is needed in the trainer. The libraries that write it
are not used on purpose: `tensorboard` (a test dependency, whose reader checks these files) would
bring grpcio, werkzeug and its data server into every install, and tensorboardX imports torch
whenever torch is installed (about 240 MiB and seconds of start-up in the trainer) and runs a
thread and a queue per file for what is one append per step here (measured installed:
tensorboard 12 MB, its data server 20 MB, grpcio 19 MB). The checksum is a 256-entry CRC32C table
(`_crc32c`) rather than `google-crc32c`, which only the gcs extra brings: at one small record per
step its speed does not matter, and tests/unit/train/test_metrics_io.py checks the checksums
through TensorBoard's own reader.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "split", "time")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# --- TensorBoard record encoding -------------------------------------------------------------


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord files use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked CRC of the length, data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", _masked_crc(length))
        + data
        + struct.pack("<I", _masked_crc(data))
    )


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values use ten-byte two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    """Serialized Event: wall_time = 1 (double), step = 2 (int64), then a oneof field."""
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def _scalar_summary(values: Mapping[str, float]) -> bytes:
    """Event.summary (field 5): Summary.value (1) = [Value{tag = 1, simple_value = 2 (float)}]."""
    summary = b"".join(
        _field_bytes(1, _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
        for tag, value in values.items()
    )
    return _field_bytes(5, summary)


class EventFileWriter:
    """Appends scalar summaries to one `events.out.tfevents.*` file in `logdir`."""

    _counter = 0

    def __init__(self, logdir: str | os.PathLike[str], *, purge_step: int | None = None) -> None:
        Path(logdir).mkdir(parents=True, exist_ok=True)
        EventFileWriter._counter += 1
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = Path(logdir) / f"{name}.{os.getpid()}.{EventFileWriter._counter}"
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        now = time.time()
        self._file.write(_record(_event(now, 0, _field_bytes(3, b"brain.Event:2"))))
        if purge_step is not None:
            # SessionLog{status: START} (Event field 7): TensorBoard hides events of earlier
            # files whose step is >= purge_step, i.e. those of the run being resumed over.
            self._file.write(_record(_event(now, purge_step, _field_bytes(7, b"\x08\x01"))))
        self._file.flush()

    def add_scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        """Write one event holding every value of `values` as a scalar tagged with its key."""
        if values:
            self._file.write(_record(_event(wall_time, step, _scalar_summary(values))))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# --- JSONL metrics ---------------------------------------------------------------------------


def _to_json_value(key: str, value: Any) -> int | float | str:
    """A JSON-safe number: ints stay ints, floats stay floats, non-finite floats become strings."""
    if isinstance(value, numbers.Integral):  # bool, int, numpy integers
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} is not a number: {value!r}") from err
    if math.isfinite(number):
        return number
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def _from_json_value(value: Any) -> Any:
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


def _parse_line(line: str) -> dict[str, Any] | None:
    """A record from one line of metrics.jsonl, or None for a blank or torn line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def read_metrics(workdir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of `WORKDIR/metrics.jsonl` in file order; "nan"/"inf"/"-inf" become floats.

    A torn or malformed line (e.g. from a crash mid-write) is skipped with a warning.
    """
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        record = _parse_line(line)
        if record is None:
            if line.strip():
                logger.warning("%s:%d: skipping malformed metrics line", path, number)
            continue
        records.append(
            {k: v if k in RESERVED_KEYS else _from_json_value(v) for k, v in record.items()}
        )
    return records


def truncate_metrics(workdir: str | os.PathLike[str], step: int) -> int:
    """Drop records with step > `step` (and torn lines) from metrics.jsonl, atomically.

    Returns the number of lines dropped.
    """
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = [ln for ln in lines if (rec := _parse_line(ln)) is not None and rec["step"] <= step]
    dropped = sum(1 for ln in lines if ln.strip()) - len(kept)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write("".join(ln + "\n" for ln in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class TensorBoardSink:
    """Scalars to TensorBoard event files, one folder per split under `WORKDIR/tensorboard/` (the
    sink `tensorboard` of `train.report_to`). `resume_step=N` (a run restarted from step N) hides
    the old events of steps > N, in every split already there."""

    def __init__(self, workdir: str | os.PathLike[str], *, resume_step: int | None = None):
        self.root = Path(workdir) / TENSORBOARD_DIR
        self.resume_step = resume_step
        self._events: dict[str, EventFileWriter] = {}
        if resume_step is not None and self.root.is_dir():
            # Mark every existing split now, so later steps of a split that is not written again
            # (e.g. an eval that came after the checkpoint) are hidden in TensorBoard too.
            for split_dir in sorted(self.root.iterdir()):
                if split_dir.is_dir():
                    self._event_file(split_dir.name)

    def _event_file(self, split: str) -> EventFileWriter:
        events = self._events.get(split)
        if events is None:
            purge = None if self.resume_step is None else self.resume_step + 1
            events = EventFileWriter(self.root / split, purge_step=purge)
            self._events[split] = events
        return events

    def write(self, step: int, values: Mapping[str, float], split: str) -> None:
        events = self._event_file(split)
        events.add_scalars(step, values, time.time())
        events.flush()

    def flush(self) -> None:
        for events in self._events.values():
            events.flush()

    def close(self) -> None:
        for events in self._events.values():
            events.close()


class MetricsWriter:
    """Writes metrics to `WORKDIR/metrics.jsonl` and every sink in `sinks` (`dpojax.train.tracking`:
    TensorBoard, W&B, MLflow); `tensorboard=True` adds a `TensorBoardSink` first.

    `enabled=False` (every process but 0 in a multi-host run) makes every method a no-op.
    `resume_step=N` (a run restarted from the checkpoint of step N) first drops metrics of
    steps > N from metrics.jsonl and tells TensorBoard to hide the old events of those steps.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        enabled: bool = True,
        resume_step: int | None = None,
        tensorboard: bool = True,
        sinks: Sequence[Any] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.enabled = enabled
        self.resume_step = resume_step
        self.tensorboard = tensorboard
        self.sinks = list(sinks) if enabled else []
        self._jsonl = None
        self._closed = False
        if not enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            dropped = truncate_metrics(self.workdir, resume_step)
            if dropped:
                logger.info("dropped %d metric lines after step %d", dropped, resume_step)
        if tensorboard:
            self.sinks.insert(0, TensorBoardSink(self.workdir, resume_step=resume_step))
        self._jsonl = open(self.workdir / METRICS_FILE, "a")  # noqa: SIM115 - closed in close()

    @property
    def path(self) -> Path:
        """The JSONL file."""
        return self.workdir / METRICS_FILE

    def write(self, step: int, metrics: Mapping[str, Any], split: str = "train") -> None:
        """Append one record `{"step", "split", "time", **metrics}` and the TensorBoard scalars."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsWriter is closed")
        if not split or not split.replace("_", "").replace("-", "").isalnum():
            raise ValueError(
                f"split must be a simple name such as 'train' or 'eval', got {split!r}"
            )
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for key in metrics:
            if key in RESERVED_KEYS:
                raise ValueError(f"metric name {key!r} is reserved ({', '.join(RESERVED_KEYS)})")
        values = {str(k): _to_json_value(str(k), v) for k, v in metrics.items()}
        now = time.time()
        record = {"step": step, "split": split, "time": round(now, 3), **values}
        try:
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
        except OSError as e:  # e.g. a full disk: name the file
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        floats = {k: float(_from_json_value(v)) for k, v in values.items()}
        for sink in self.sinks:
            sink.write(step, floats, split)

    def flush(self) -> None:
        """Flush both outputs to the operating system and the JSONL file to disk."""
        if not self.enabled or self._closed:
            return
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())
        for sink in self.sinks:
            if hasattr(sink, "flush"):
                sink.flush()

    def close(self) -> None:
        """Flush and close; further writes raise. Safe to call twice. Every output is closed even
        when one fails (a full disk), then the first error is raised: a file left open would
        fail again when Python finalizes it, printing a traceback after the run's last line."""
        if not self.enabled or self._closed:
            return
        first: Exception | None = None
        for close in [self.flush, self._jsonl.close, *(sink.close for sink in self.sinks)]:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the others still close; this one is raised
                first = first or e
        self._closed = True
        if first is not None:
            raise first

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
