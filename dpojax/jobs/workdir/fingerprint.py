"""What a training run's inputs were, recorded when it starts and checked when it resumes: the
policy's and the reference's weights (and, for a Hub id, the revision it resolved to). The data's
own fingerprint travels in every checkpoint (`dpojax.data.pipeline.content_fingerprint`).

A model folder's fingerprint hashes every top-level file a load reads (configs, tokenizer,
chat template, weights): small files whole; large ones (the safetensors shards) by their size,
their first MiB (a safetensors header: every tensor's name, dtype, shape and offsets) and a 4 KiB
block at the start, middle and end of every tensor. Reading a 100 GB model whole would cost
minutes at every start; the sampled blocks cost milliseconds and change whenever a tensor is
replaced by other trained weights (every block of a retrained tensor differs). It does not depend
on file times, so a copied or re-downloaded folder resumes. An edit confined to unsampled bytes
is not seen: that is the trade.

Over several processes, every process's settings and data are compared with process 0's before
the first step (`check_processes_agree`): processes started with different configs (one given
another learning rate) or reading different data stop, all of them, instead of mixing weights.

WORKDIR/inputs.json holds the record; a resume whose inputs differ is refused naming them
(`InputChanged`, exit 3) unless `allow_input_change=True`, which logs the change in
config_changes.jsonl and continues.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from dpojax.errors import ConfigProblem, InputProblem
from dpojax.jobs.workdir import CHANGES_FILE, atomic_write_text, config_changes, config_record
from dpojax.models.hub import MODEL_FILES, is_hub_id, resolve_model_dir, split_revision
from dpojax.models.safetensors_io import ModelFileError, read_header

log = logging.getLogger(__name__)

INPUTS_FILE = "inputs.json"
WHOLE_FILE_BYTES = 8 << 20
HEAD_BYTES = 1 << 20
SAMPLES, SAMPLE_BYTES = 256, 4 << 10


class InputChanged(InputProblem):
    """A resumed run's model or data differ from those the run started with."""


def _tensor_spans(path: Path) -> list[tuple[int, int]] | None:
    """(start, end) of every tensor's bytes in a safetensors file (None: not one)."""
    try:
        header, data = read_header(path)
    except (ModelFileError, ValueError):
        return None
    return sorted(
        (data + int(v["data_offsets"][0]), data + int(v["data_offsets"][1]))
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    )


def file_fingerprint(path: Path) -> str:
    """sha256 of a file: whole up to WHOLE_FILE_BYTES. Beyond, its size and head, then in a
    safetensors file a block at the start, middle and end of every tensor (so no replaced tensor
    goes unseen), in any other file SAMPLES blocks spread evenly."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_BYTES:
            h.update(f.read())
            return h.hexdigest()
        spans = _tensor_spans(path) if path.suffix == ".safetensors" else None
        h.update(f.read(HEAD_BYTES))
        if spans is None:
            step = (size - SAMPLE_BYTES) / (SAMPLES - 1)
            offsets = [int(i * step) for i in range(SAMPLES)]
        else:
            offsets = [o for a, b in spans for o in (a, (a + b) // 2, b - SAMPLE_BYTES)]
        for offset in offsets:
            f.seek(max(offset, 0))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def folder_fingerprint(directory: Path) -> str:
    """sha256 over the names and `file_fingerprint`s of the model files at the top of
    `directory` (those a load reads: `dpojax.models.hub.MODEL_FILES`)."""
    names = sorted(
        p.name
        for p in Path(directory).iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pattern) for pattern in MODEL_FILES)
    )
    h = hashlib.sha256()
    for name in names:
        h.update(f"{name}\0{file_fingerprint(Path(directory) / name)}\0".encode())
    return h.hexdigest()


def _model_record(ref: str) -> dict[str, Any]:
    directory = resolve_model_dir(ref)
    record = {"path": ref, "weights": folder_fingerprint(directory)}
    if is_hub_id(ref):  # the snapshot folder is named by the commit the id resolved to
        record["revision"] = directory.name
    return record


def model_inputs(config) -> dict[str, Any]:
    """{"model": {...}, "reference": {...}}: path, weights fingerprint and Hub revision of the
    policy and of reference.path (the policy's own when it is not set)."""
    model = _model_record(config.model.path)
    ref = config.reference.path
    return {"model": model, "reference": _model_record(ref) if ref else model}


def _differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[str]]:
    out = {}
    for role in ("model", "reference"):
        a, b = old.get(role) or {}, new[role]
        lines = []
        if a.get("revision") and b.get("revision") and a["revision"] != b["revision"]:
            repo = split_revision(b["path"])[0]
            lines.append(
                f"{role}.path: {b['path']} is now revision {b['revision']}, the run started on "
                f"{a['revision']} (pass {role}.path={repo}@{a['revision']} to resume on it)"
            )
        elif a.get("weights") != b["weights"]:
            lines.append(
                f"{role}.path: the files in {b['path']} are not those the run started with"
            )
        if lines:
            out[f"{role}.path"] = lines
    return out


def record_input_change(workdir: Path, changes: dict[str, list[str]]) -> None:
    """Logs inputs accepted under allow_input_change and appends them to config_changes.jsonl."""
    text = "; ".join(f"{k}: {', '.join(v)}" for k, v in changes.items())
    log.warning("continuing %s on changed inputs (allow_input_change): %s", workdir, text)
    line = {"time": time.time(), "inputs": changes}
    with open(Path(workdir) / CHANGES_FILE, "a") as f:
        f.write(json.dumps(line) + "\n")


def check_inputs(config, workdir: Path, *, resuming: bool) -> None:
    """A fresh run records its model inputs in WORKDIR/inputs.json; a resumed one compares them
    with the record (`InputChanged`, or with allow_input_change the change logged and the record
    renewed). A workdir from before the record existed gets one."""
    path = Path(workdir) / INPUTS_FILE
    new = model_inputs(config)
    old = None
    if resuming and path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            raise InputChanged(
                f"{path} is not valid JSON: restore it, or delete it to record the current model"
            ) from None
    changes = _differences(old, new) if isinstance(old, dict) else {}
    if changes and not config.allow_input_change:
        text = "; ".join(line for lines in changes.values() for line in lines)
        raise InputChanged(
            f"{workdir} holds a run started on another model: {text}; put the original back to "
            f"resume, start afresh with another --workdir, or pass "
            "--config.allow_input_change=True to continue on the new one"
        )
    if changes:
        record_input_change(workdir, changes)
    if old != new:
        atomic_write_text(path, json.dumps(new, indent=2))


class ProcessesDisagree(ConfigProblem):
    """The processes of one run were started with different settings or read different data."""


def check_processes_agree(config, data_fingerprint: str) -> None:
    """Raises `ProcessesDisagree` on every process when any process's settings (run-control keys
    such as distributed.process_id aside) or training data differ from process 0's."""
    from dpojax.train import hosts

    mine = {"config": config_record(config), "data": data_fingerprint}
    every = hosts.allgather_json(mine)
    problems = []
    for index, other in enumerate(every[1:], start=1):
        changed = config_changes(every[0]["config"], other["config"])
        if changed:
            shown = ", ".join(f"{k} ({a!r} vs {b!r})" for k, (a, b) in list(changed.items())[:6])
            problems.append(f"process {index} has other settings than process 0: {shown}")
        if other["data"] != every[0]["data"]:
            problems.append(f"process {index} read other training data than process 0")
    if problems:
        raise ProcessesDisagree(
            "; ".join(problems) + "; start every process with the same command, config and "
            "data files"
        )
