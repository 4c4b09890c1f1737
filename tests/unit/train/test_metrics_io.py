"""MetricsWriter: JSONL records, TensorBoard event files (read back), resume truncation."""

import json
import math
import struct
import time

import numpy as np
import pytest

from dpojax.train.metrics_io import MetricsWriter, crc32c, read_metrics, truncate_metrics

# --- an independent reader for TFRecord files of tensorflow.Event protos ---------------------


def _masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path):
    data = path.read_bytes()
    pos, out = 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert length_crc == _masked(crc32c(header))
        payload = data[pos + 12 : pos + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert payload_crc == _masked(crc32c(payload))
        out.append(payload)
        pos += 16 + length
    assert pos == len(data)
    return out


def _fields(buf):
    """Protobuf wire format -> list of (field number, wire type, value)."""
    pos, out = 0, []

    def varint():
        nonlocal pos
        shift = value = 0
        while True:
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while pos < len(buf):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n = varint()
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((number, wire, value))
    return out


def _events(logdir):
    """Every event of every file in `logdir`, as dicts: wall_time, step, and one of
    file_version / scalars {tag: value} / session_start."""
    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for payload in _records(path):
            event = {"file": path.name}
            for number, wire, value in _fields(payload):
                if number == 1:
                    assert wire == 1
                    event["wall_time"] = struct.unpack("<d", value)[0]
                elif number == 2:
                    assert wire == 0
                    event["step"] = value
                elif number == 3:
                    event["file_version"] = value.decode()
                elif number == 5:
                    scalars = {}
                    for _, _, summary_value in _fields(value):
                        parts = {n: (w, v) for n, w, v in _fields(summary_value)}
                        assert parts[2][0] == 5  # simple_value is a 32-bit float
                        scalars[parts[1][1].decode()] = struct.unpack("<f", parts[2][1])[0]
                    event["scalars"] = scalars
                elif number == 7:
                    event["session_start"] = dict((n, v) for n, _, v in _fields(value))[1] == 1
            events.append(event)
    return events


def _scalars(logdir, tag):
    return [(e["step"], e["scalars"][tag]) for e in _events(logdir) if tag in e.get("scalars", {})]


# --- tests -----------------------------------------------------------------------------------

TRAIN = {
    "loss": 0.6931,
    "rewards/chosen": 0.01,
    "rewards/rejected": -0.02,
    "rewards/accuracies": 0.75,
    "rewards/margins": 0.03,
    "logps/chosen": -40.5,
    "logps/rejected": -42.25,
    "learning_rate": 5e-7,
    "grad_norm": 1.5,
    "tokens_per_s": 1234.5,
}


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_jsonl_records_in_order(tmp_path):
    start = time.time()
    with MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {**TRAIN, "loss": 0.7 - 0.1 * step})
        writer.write(3, {"loss": 0.55, "rewards/accuracies": 0.5}, split="eval")
        writer.write(4, {"loss": np.float32(0.25), "tokens": np.int64(512), "flag": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["split"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (3, "eval"),
        (4, "train"),
    ]
    assert list(records[0])[:3] == ["step", "split", "time"]
    assert all(start - 1 <= r["time"] <= time.time() + 1 for r in records)
    assert set(records[0]) == {"step", "split", "time", *TRAIN}
    assert records[1]["loss"] == pytest.approx(0.5)
    assert records[0]["rewards/accuracies"] == 0.75
    assert records[3] == {**records[3], "loss": 0.55, "rewards/accuracies": 0.5}
    assert records[4]["tokens"] == 512 and isinstance(records[4]["tokens"], int)
    assert records[4]["flag"] == 1
    assert read_metrics(tmp_path) == records


def test_non_finite_values_are_valid_json(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": math.nan, "grad_norm": math.inf, "m": -math.inf, "a": 1.0})
        writer.write(2, {"loss": np.float32("nan"), "grad_norm": np.array(np.inf)})

    def reject(token):
        raise AssertionError(f"invalid JSON constant {token}")

    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=reject)
    first, second = read_metrics(tmp_path)
    assert math.isnan(first["loss"]) and first["grad_norm"] == math.inf
    assert first["m"] == -math.inf and first["a"] == 1.0
    assert math.isnan(second["loss"]) and second["grad_norm"] == math.inf
    assert math.isnan(_scalars(tmp_path / "tensorboard" / "train", "loss")[0][1])


def test_tensorboard_events_contain_tags_and_values(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in (10, 20):
            writer.write(step, {**TRAIN, "loss": 1.0 / step})
        writer.write(20, {"loss": 0.125, "rewards/accuracies": 0.625}, split="eval")
    train_dir, eval_dir = tmp_path / "tensorboard" / "train", tmp_path / "tensorboard" / "eval"
    events = _events(train_dir)
    assert events[0]["file_version"] == "brain.Event:2"
    tags = set().union(*(e.get("scalars", {}) for e in events))
    assert tags == set(TRAIN)
    assert _scalars(train_dir, "loss") == [(10, pytest.approx(0.1)), (20, pytest.approx(0.05))]
    for tag, value in TRAIN.items():
        if tag != "loss":
            expected = pytest.approx(value, rel=1e-6)
            assert _scalars(train_dir, tag) == [(10, expected), (20, expected)]
    assert _scalars(eval_dir, "loss") == [(20, 0.125)]
    assert _scalars(eval_dir, "rewards/accuracies") == [(20, 0.625)]
    assert all(abs(e["wall_time"] - time.time()) < 60 for e in events)
    assert not any("session_start" in e for e in events)


def test_tensorboard_reader_agrees(tmp_path):
    """Cross-check with TensorBoard's own reader (a test dependency)."""
    from tensorboard.backend.event_processing import event_accumulator as accumulator

    with MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"rewards/accuracies": step / 4, "loss": 1.0})
    with MetricsWriter(tmp_path, resume_step=1) as writer:
        writer.write(2, {"rewards/accuracies": 0.125, "loss": 2.0})
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "train"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"rewards/accuracies", "loss"}
    got = [(e.step, e.value) for e in acc.Scalars("rewards/accuracies")]
    assert got == [(1, 0.25), (2, 0.125)]


def test_resume_drops_later_steps(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(1, 7):
            writer.write(step, {"loss": float(step)})
            if step % 3 == 0:
                writer.write(step, {"loss": step + 0.5}, split="eval")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "split": "train", "loss')  # torn by a crash mid-write
    with MetricsWriter(tmp_path, resume_step=4) as writer:
        assert [(r["step"], r["split"]) for r in read_metrics(tmp_path)] == [
            (1, "train"),
            (2, "train"),
            (3, "train"),
            (3, "eval"),
            (4, "train"),
        ]
        for step in (5, 6):
            writer.write(step, {"loss": 10.0 + step})
        writer.write(6, {"loss": 0.0}, split="eval")
    records = read_metrics(tmp_path)
    for split in ("train", "eval"):
        steps = [r["step"] for r in records if r["split"] == split]
        assert steps == sorted(set(steps))
    assert [r["loss"] for r in records if r["split"] == "train"] == [1.0, 2.0, 3.0, 4.0, 15.0, 16.0]
    assert not list(tmp_path.glob("*.tmp"))
    # Both splits got a TensorBoard "restart at step 5" marker, hiding the old steps 5 and 6.
    for split in ("train", "eval"):
        starts = [e for e in _events(tmp_path / "tensorboard" / split) if "session_start" in e]
        assert len(starts) == 1 and starts[0]["step"] == 5 and starts[0]["session_start"]


def test_truncate_without_later_steps_leaves_file_alone(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"loss": 1.0})
    before = (tmp_path / "metrics.jsonl").stat().st_mtime_ns
    assert truncate_metrics(tmp_path, 5) == 0
    assert (tmp_path / "metrics.jsonl").stat().st_mtime_ns == before
    assert truncate_metrics(tmp_path / "missing", 5) == 0


def test_disabled_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    with MetricsWriter(workdir, enabled=False) as writer:
        writer.write(1, {"loss": 1.0})
        writer.write(1, {"loss": 1.0}, split="eval")
        writer.flush()
    assert not workdir.exists()
    with MetricsWriter(tmp_path) as writer:
        writer.write(5, {"loss": 1.0})
    content = (tmp_path / "metrics.jsonl").read_text()
    MetricsWriter(tmp_path, enabled=False, resume_step=1).close()
    assert (tmp_path / "metrics.jsonl").read_text() == content
    assert read_metrics(workdir) == []


def test_bad_input_is_rejected(tmp_path):
    writer = MetricsWriter(tmp_path)
    with pytest.raises(ValueError, match="reserved"):
        writer.write(1, {"step": 1.0})
    with pytest.raises(TypeError, match="'note'"):
        writer.write(1, {"note": "hello"})
    with pytest.raises(ValueError, match="split"):
        writer.write(1, {"loss": 1.0}, split="../x")
    with pytest.raises(ValueError, match="step"):
        writer.write(-1, {"loss": 1.0})
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(1, {"loss": 1.0})
    assert read_metrics(tmp_path) == []
