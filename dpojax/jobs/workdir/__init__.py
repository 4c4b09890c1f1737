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

from dpojax import schema
from dpojax.config import Config
from dpojax.errors import ConfigProblem, one_line

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"
# A saved config's file names end so (JSON, YAML); any other --config is a recipe (configs/*.py).
SAVED_SUFFIXES = (".json", ".yaml", ".yml")
# Keys that change how a run is carried out or watched, never what it computes: a re-run may
# change them freely. (loop.rounds, loop.max_wall_seconds and loop.gate_rounds extend or shorten
# a loop; finished rounds stay as they are.)
RUN_CONTROL_KEYS = (
    "allow_config_change",
    "allow_input_change",
    "compilation_cache_dir",
    "compilation_cache_min_seconds",
    "train.progress",
    "train.report_plots",
    "train.early_stopping_patience",
    "train.early_stopping_threshold",
    "train.log_completions_every",
    "train.log_completions_count",
    "train.log_completions_max_tokens",
    "checkpoint.async_save",
    "checkpoint.on_corrupt",
    "loop.rounds",
    "loop.max_wall_seconds",
    "loop.gate_rounds",
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


def config_record(config: Config) -> dict[str, Any]:
    """The typed config as written to WORKDIR/config.json (JSON types; secrets redacted), in the
    order and shape of its ConfigDict."""
    record = json.loads(json.dumps(schema.as_dict(config), default=str))
    for key in SECRET_KEYS:
        group, _, name = key.rpartition(".")
        node = record
        for part in group.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(name):
            node[name] = "<redacted>"
    return record


def settings_text(config: Config) -> str:
    """The settings of `config` that differ from the defaults, one `key = value` line each
    (secrets redacted), for a report: the whole config is WORKDIR/config.json."""
    from dpojax.config import default_config, frozen

    defaults = _flat(config_record(frozen(default_config())))
    changed = {k: v for k, v in _flat(config_record(config)).items() if defaults.get(k) != v}
    lines = [f"{key} = {json.dumps(value)}" for key, value in changed.items()]
    head = "# the settings that differ from the defaults; every key: config.json"
    return "\n".join([head, *lines]) if lines else "# every setting is its default"


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
    return _with_changes(workdir, settings)


def _with_changes(workdir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` (flat) with the changes WORKDIR/config_changes.jsonl records applied."""
    log_path = workdir / CHANGES_FILE
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            try:
                changes = json.loads(line)["changes"]
            except (ValueError, KeyError, TypeError):
                continue
            settings.update({k: v[1] for k, v in changes.items()})
    return settings


# The groups of keys that decide the shapes of a run's checkpoint (the model, its adapters, the
# optimizer state, a reference model kept in the state).
STATE_KEYS = ("model.", "lora.", "optim.name", "reference.")


def used_settings(config: Config, workdir: Path) -> str | None:
    """For a checkpoint that does not fit `config`: the settings the workdir's run used that
    `config` changes among those that shape the checkpoint ("this run used lora.rank=16 (this
    command: 0)"), or None (no config.json, or no such difference)."""
    if not (workdir / CONFIG_FILE).is_file():
        return None
    changed = {
        key: values
        for key, values in config_changes(_effective(workdir), config_record(config)).items()
        if key.startswith(STATE_KEYS)
    }
    if not changed:
        return None
    used = ", ".join(f"{k}={old!r} (this command: {new!r})" for k, (old, new) in changed.items())
    return (
        f"this run used {used}; leave out --config to start from {workdir / CONFIG_FILE}, or "
        "set the same values"
    )


def check_config(config: Config, workdir: Path, *, resuming: bool) -> None:
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
    if not config.allow_config_change:
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


def _read_saved(path: Path) -> dict[str, Any]:
    """The flat settings of a saved config file (JSON, or YAML by its suffix)."""
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            tree = yaml.safe_load(text)
        else:
            tree = json.loads(text)
    except Exception as e:  # noqa: BLE001 - json.JSONDecodeError, yaml.YAMLError
        raise ConfigProblem(f"{path}: not a saved config ({one_line(e)})") from None
    if not isinstance(tree, Mapping):
        raise ConfigProblem(f"{path}: not a saved config (a mapping of keys was expected)")
    return _flat(tree)


def saved_config(source: str | os.PathLike) -> ml_collections.ConfigDict:
    """The config of a finished or running run, from its workdir (WORKDIR/config.json with the
    changes config_changes.jsonl records) or from a saved config file (JSON, or YAML by its
    suffix): the defaults with the file's values on top. Redacted secrets fall back to their
    defaults; an unknown key or a value of the wrong type is refused, naming the file."""
    from dpojax.config import check_keys, default_config
    from dpojax.errors import ConfigErrors

    path = Path(source)
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ConfigProblem(f"{path} holds no {CONFIG_FILE}: it is not a dpojax run's workdir")
        where = path / CONFIG_FILE
        settings = _with_changes(path, _read_saved(where))
    elif path.is_file():
        settings, where = _read_saved(path), path
    else:
        raise ConfigProblem(f"{path}: no such saved config or workdir")
    config = default_config()
    errors = check_keys(ml_collections.ConfigDict(_nested(settings)))
    if errors:
        raise ConfigErrors([f"{where}: {line}" for line in errors])
    for key, value in settings.items():
        if key in SECRET_KEYS and value == "<redacted>":
            continue
        *groups, name = key.split(".")
        node = config
        for part in groups:
            node = node[part]
        default = node[name]
        if isinstance(default, tuple):
            value = tuple(value)
        elif isinstance(default, float) and not isinstance(value, bool):
            value = float(value)
        node[name] = value
    return config


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *groups, name = key.split(".")
        node = tree
        for part in groups:
            node = node.setdefault(part, {})
        node[name] = value
    return tree
