"""What a job keeps in its workdir so that a re-run continues it safely: the run's original
config (a re-run with other settings is refused, naming the keys, unless
`allow_config_change=True`), and files and directories replaced whole or not at all (a kill
mid-write leaves the previous version). README.md#interruptions-and-restarts describes what
survives which interruption."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_collections

from dpojax.errors import ConfigProblem

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# Keys that change how a run is carried out or watched, never what it computes: a re-run may
# change them freely. (loop.rounds and loop.max_wall_seconds extend or shorten a loop; finished
# rounds stay as they are.)
RUN_CONTROL_KEYS = (
    "allow_config_change",
    "allow_input_change",
    "compilation_cache_dir",
    "compilation_cache_min_seconds",
    "train.progress",
    "train.report_plots",
    "checkpoint.async_save",
    "loop.rounds",
    "loop.max_wall_seconds",
    "loop.keep_round_files",
    "distributed.",
    "customizer.hf_token",
)
SECRET_KEYS = ("customizer.hf_token",)


class ConfigChanged(ConfigProblem):
    """A re-run's settings differ from those the workdir's run started with."""


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_record(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as written to WORKDIR/config.json (JSON types; secrets redacted)."""
    record = json.loads(config.to_json_best_effort())
    for key in SECRET_KEYS:
        group, _, name = key.rpartition(".")
        node = record
        for part in group.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(name):
            node[name] = "<redacted>"
    return record


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} for every key that differs, run-control keys
    aside (`old` and `new` nested, or flat with dotted keys)."""
    a, b = _flat(old), _flat(new)
    changed = {}
    for key in sorted(a.keys() | b.keys()):
        if key.startswith(RUN_CONTROL_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            changed[key] = (a.get(key, "<absent>"), b.get(key, "<absent>"))
    return changed


def _describe(changed: Mapping[str, tuple]) -> str:
    shown = [f"{k} ({old!r} -> {new!r})" for k, (old, new) in list(changed.items())[:6]]
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return ", ".join(shown) + more


def _effective(workdir: Path) -> dict[str, Any]:
    """The settings the workdir's run goes on with: its config.json with the changes that
    config_changes.jsonl records applied (flat, dotted keys)."""
    try:
        settings = _flat(json.loads((workdir / CONFIG_FILE).read_text()))
    except ValueError:
        settings = {}
    log_path = workdir / CHANGES_FILE
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            try:
                changes = json.loads(line)["changes"]
            except (ValueError, KeyError, TypeError):
                continue
            settings.update({k: v[1] for k, v in changes.items()})
    return settings


def check_config(config: ml_collections.ConfigDict, workdir: Path, *, resuming: bool) -> None:
    """Before a run writes anything: when `resuming` a run whose WORKDIR/config.json differs
    from `config` (with the changes config_changes.jsonl records), raise `ConfigChanged` naming
    the keys; with `allow_config_change=True` log them and record them in
    WORKDIR/config_changes.jsonl instead. The original config.json is kept; a fresh run (not
    `resuming`) writes it."""
    path = workdir / CONFIG_FILE
    new = config_record(config)
    if not resuming or not path.is_file():
        atomic_write_text(path, json.dumps(new, indent=2))
        return
    changed = config_changes(_effective(workdir), new)
    if not changed:
        return
    if not config.get("allow_config_change", False):
        raise ConfigChanged(
            f"{workdir} holds a run started with other settings: {_describe(changed)}; rerun "
            f"with the original settings to continue it, start afresh with another --workdir "
            f"(or delete {workdir}), or pass --config.allow_config_change=True to continue it "
            "with the new ones"
        )
    log.warning("continuing %s with changed settings: %s", workdir, _describe(changed))
    line = {"time": time.time(), "changes": {k: list(v) for k, v in changed.items()}}
    with open(workdir / CHANGES_FILE, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def atomic_write_text(path: Path, text: str) -> None:
    """Writes `path` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replaced_dir(directory: Path) -> Iterator[Path]:
    """Yields a temporary directory next to `directory` to fill; on success it replaces
    `directory` (which stays as it was if the block fails or the process dies). In a
    multi-process run only process 0 replaces `directory` (the others' writers write nothing,
    and on a shared disk they must not move process 0's result away)."""
    import jax

    directory = Path(directory)
    suffix = f"{os.getpid()}-{jax.process_index()}"
    tmp = directory.with_name(f".{directory.name}.tmp-{suffix}")
    old = directory.with_name(f".{directory.name}.old-{suffix}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if jax.process_index() == 0 and tmp.exists():
            if directory.exists():
                os.replace(directory, old)
            os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def check_workdir(workdir: str | os.PathLike) -> None:
    """Raises the OSError that writing into `workdir` would meet (a file in its place, no
    permission, a read-only disk), before any compute."""
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".dpojax-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
    finally:
        probe.unlink(missing_ok=True)
