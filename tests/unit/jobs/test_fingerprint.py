"""A run's model inputs are recorded at its start and checked on resume: replaced weights (in a
local folder or behind a Hub id that moved on) are refused naming them, unless
`allow_input_change=True`, which logs the change; a copied folder (new file times) resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dpojax.config import default_config, frozen
from dpojax.jobs.workdir import CHANGES_FILE, fingerprint
from dpojax.jobs.workdir.fingerprint import (
    INPUTS_FILE,
    InputChanged,
    check_inputs,
    file_fingerprint,
    folder_fingerprint,
)
from dpojax.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("fingerprint")
    return make_tiny_checkpoint(base / "a", seed=0), make_tiny_checkpoint(base / "b", seed=1)


def _config(model: Path, **top):
    config = default_config()
    config.model.path = str(model)
    for key, value in top.items():
        config[key] = value
    return config


def test_replaced_weights_are_refused_unless_allowed(models, tmp_path):
    """Before: a model folder whose weights were replaced resumed silently, swapping the frozen
    reference (the first resumed step's loss 1.958 instead of 0.019)."""
    a, b = models
    model = tmp_path / "model"
    shutil.copytree(a, model)
    work = tmp_path / "run"
    work.mkdir()
    check_inputs(_config(model), work, resuming=False)
    record = json.loads((work / INPUTS_FILE).read_text())
    assert record["model"] == record["reference"] and "revision" not in record["model"]

    shutil.rmtree(model)
    shutil.copytree(a, model)  # a copy: other file times, the same files
    check_inputs(_config(model), work, resuming=True)

    shutil.copy(b / "model.safetensors", model / "model.safetensors")  # other weights
    with pytest.raises(InputChanged) as info:
        check_inputs(_config(model), work, resuming=True)
    message = str(info.value)
    assert str(model) in message and "allow_input_change" in message
    assert info.value.exit_code == 3
    assert json.loads((work / INPUTS_FILE).read_text()) == record  # nothing renewed

    check_inputs(_config(model, allow_input_change=True), work, resuming=True)
    logged = json.loads((work / CHANGES_FILE).read_text().splitlines()[-1])
    assert list(logged["inputs"]) == ["model.path", "reference.path"]
    check_inputs(_config(model), work, resuming=True)  # the record now holds the new weights


def test_a_separate_reference_is_checked_too(models, tmp_path):
    a, b = models
    ref = tmp_path / "ref"
    shutil.copytree(b, ref)
    work = tmp_path / "run"
    work.mkdir()
    config = _config(a)
    config.reference.path = str(ref)
    check_inputs(config, work, resuming=False)
    (ref / "config.json").write_text((ref / "config.json").read_text().replace("}", " }", 1))
    with pytest.raises(InputChanged, match="reference.path"):
        check_inputs(config, work, resuming=True)


def test_a_hub_id_is_pinned_to_the_revision_it_started_on(models, tmp_path, monkeypatch):
    a, b = models
    snapshots = {"1" * 40: a, "2" * 40: b}
    current = {"sha": "1" * 40}

    def resolve(ref):  # a Hub id's snapshot folder is named by its commit
        folder = tmp_path / "hub" / current["sha"]
        if not folder.exists():
            shutil.copytree(snapshots[current["sha"]], folder)
        return folder

    monkeypatch.setattr(fingerprint, "resolve_model_dir", resolve)
    monkeypatch.setattr(fingerprint, "is_hub_id", lambda ref: True)
    work = tmp_path / "run"
    work.mkdir()
    check_inputs(_config("org/name"), work, resuming=False)
    assert json.loads((work / INPUTS_FILE).read_text())["model"]["revision"] == "1" * 40
    current["sha"] = "2" * 40  # main moved on
    with pytest.raises(InputChanged) as info:
        check_inputs(_config("org/name"), work, resuming=True)
    assert f"model.path=org/name@{'1' * 40}" in str(info.value)


def test_large_files_are_sampled_not_read_whole(tmp_path):
    path = tmp_path / "big.safetensors"
    size = fingerprint.WHOLE_FILE_BYTES + (3 << 20)
    path.write_bytes(bytes(size))
    before = file_fingerprint(path)
    with open(path, "r+b") as f:  # a byte inside the last sampled block
        f.seek(size - 10)
        f.write(b"\x01")
    assert file_fingerprint(path) != before
    whole = folder_fingerprint(tmp_path)
    (tmp_path / "notes.md").write_text("not read by a load")
    assert folder_fingerprint(tmp_path) == whole


def test_processes_with_other_settings_or_data_all_stop(monkeypatch):
    """Before: two processes of one run, one given another learning rate, both exited 0 with
    mixed weights. Every process sees every record, so each raises the same error."""
    from dpojax.jobs.workdir import config_record
    from dpojax.jobs.workdir.fingerprint import ProcessesDisagree, check_processes_agree
    from dpojax.train import hosts

    config = default_config()
    other = default_config()
    other.optim.learning_rate = 1e-3
    other.distributed.process_id = 1  # differs by design: not a difference
    records = [
        {"config": config_record(frozen(config)), "data": "d0"},
        {"config": config_record(frozen(other)), "data": "d0"},
        {"config": config_record(frozen(config)), "data": "d1"},
    ]
    monkeypatch.setattr(hosts, "allgather_json", lambda mine: records)
    with pytest.raises(ProcessesDisagree) as info:
        check_processes_agree(frozen(config), "d0")
    message = str(info.value)
    assert "process 1 has other settings than process 0: optim.learning_rate" in message
    assert "process 2 read other training data" in message and info.value.exit_code == 2
    monkeypatch.setattr(hosts, "allgather_json", lambda mine: [records[0], records[0]])
    check_processes_agree(frozen(config), "d0")


def test_every_tensor_of_a_large_safetensors_file_is_sampled(tmp_path):
    """A tensor replaced anywhere in a large shard changes the fingerprint, though only a few
    KiB per tensor are read."""
    import numpy as np

    from dpojax.models.safetensors_io import read_header, save_tensors

    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal(700_000).astype(np.float32) for i in range(4)}
    path = tmp_path / "model.safetensors"
    save_tensors(tensors, path)
    assert path.stat().st_size > fingerprint.WHOLE_FILE_BYTES
    before = file_fingerprint(path)
    header, start = read_header(path)
    begin, end = header["t2"]["data_offsets"]
    with open(path, "r+b") as f:  # the middle of one tensor
        f.seek(start + (begin + end) // 2)
        f.write(b"\x7f\x7f\x7f\x7f")
    assert file_fingerprint(path) != before
