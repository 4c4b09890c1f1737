"""Checkpoints of the trainable part of a `TrainState`, with orbax's `CheckpointManager`.

A checkpoint holds `state.step`, `state.params` and `state.opt_state` (item `state`) and a JSON
dict (item `extra`: data iterator position, RNG seed, config snapshot, ...). `frozen` is never
saved, nor is `ref` unless it moves (TR-DPO, `state.ref_moves`: then `ref` and `ref_adapters`
are saved too): they are rebuilt from the model directory and taken from the restore template.
bco's running reward moments (`state.moments`) are saved when the state has them (bco runs
only: every other run's checkpoints hold the same arrays as before).

Guarantees relied on (and tested in tests/unit/train/test_checkpoint.py):
  * orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it into place once every
    process has finished (on GCS: a commit_success file instead), and deletes the steps that
    retention drops only after that commit; so a crash (even SIGKILL) mid-save leaves the previous
    steps intact and a fresh manager never lists the unfinished step; leftovers are removed on the
    next start;
  * an asynchronous save copies the arrays to host memory before `save` returns, so the caller may
    donate or overwrite the state right away;
  * all processes call `save` / `restore`; orbax writes each array shard once and the JSON items
    from the primary process only, and reads each host's shards from the template's shardings.

Every checkpoint carries content checksums (`dpojax.train.integrity`): one per saved array (per
shard in a multi-process run) and one of `extra`, recorded in `extra` at the save and compared at
every restore, so a checkpoint whose files changed after the save is refused naming the step, its
folder and the arrays that differ (`CheckpointCorrupt`) instead of being restored with what was
read. In a multi-process run `save` and `restore` exchange the checksums between the processes
(host all-gathers, at the same point of every process's call), and all processes refuse a
corrupt checkpoint together, with the same message. `restore(...,
fallback=True)` goes back to the newest earlier step that verifies instead; `set_aside` moves the
steps passed over out of the way (to `<step>.corrupt`), so the run can save those steps again.

Why one module of this length: saving, the checksums recorded with a save and the restore that
verifies them (and falls back) are one protocol with orbax's manager; split apart, the guarantees
above would hold only across files.

Arrays are written uncompressed unless `compress=True`: orbax's default zstd compression holds a
compressed copy of the state in host memory while it writes (a 1B model's 15 GB train state took
a GPU host from 6 to 34 GB resident) and takes longer, for checkpoints ~10% smaller (float32 weights
and Adam moments compress poorly). Either kind restores with either setting.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocm

from dpojax.errors import InputProblem, interruption_in
from dpojax.models.scan import STACK
from dpojax.train import hosts, integrity
from dpojax.train.state import TrainState
from dpojax.urls import COMMIT_MARKER, is_url

log = logging.getLogger(__name__)

STATE_ITEM = "state"
EXTRA_ITEM = "extra"
SAVED_FIELDS = ("step", "params", "opt_state")
# Saved too when the reference moves during training (TR-DPO).
MOVING_REFERENCE_FIELDS = ("ref", "ref_adapters")
# Saved too when the state has them (bco's running reward moments).
OPTIONAL_FIELDS = ("moments",)
BEST_MODES = ("min", "max")
# What a restore of the latest checkpoint does when it is corrupt: raise, or go back to the newest
# earlier step that verifies (`restore(..., fallback=True)`).
ON_CORRUPT = ("stop", "previous")


class _StateHandler(ocp.StandardCheckpointHandler):
    """orbax's standard handler with the compression of the arrays chosen
    (`ocp.PyTreeCheckpointHandler(use_compression=...)` underneath; the standard handler does not
    expose the option). Should an orbax release build the standard handler differently, its own
    (compressed) writer stays."""

    def __init__(self, compress: bool):
        super().__init__()
        if isinstance(getattr(self, "_impl", None), ocp.PyTreeCheckpointHandler):
            self._impl = ocp.PyTreeCheckpointHandler(use_compression=compress)
        else:  # pragma: no cover - other orbax releases
            log.warning("orbax's standard handler changed; checkpoints are written compressed")


# The items' arguments name their handler in orbax's registry, so `_StateHandler` has its own.
@ocp.args.register_with_handler(_StateHandler, for_save=True)
class _StateSave(ocp.args.StandardSave):
    pass


@ocp.args.register_with_handler(_StateHandler, for_restore=True)
class _StateRestore(ocp.args.StandardRestore):
    pass


class CheckpointError(InputProblem):
    """A checkpoint that cannot be restored (missing, corrupt, or from another model)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files cannot be read or whose content fails its checksums: an earlier
    step may still be good (`Checkpointer.restore(..., fallback=True)`)."""


def _flat(state: TrainState) -> tuple[dict[tuple[str, ...], Any], jax.tree_util.PyTreeDef, list]:
    """({path: leaf}, treedef, paths in leaf order) of the saved fields of `state`. Paths are
    strings like ('params', 'layers', '0', 'mlp', 'up_proj', 'kernel'); the trailing `.value` of an
    nnx Variable is dropped."""
    fields = SAVED_FIELDS + (MOVING_REFERENCE_FIELDS if state.ref_moves else ())
    fields += tuple(f for f in OPTIONAL_FIELDS if getattr(state, f) is not None)
    tree = {name: getattr(state, name) for name in fields}
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat, order = {}, []
    for path, leaf in with_path:
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        key = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        flat[key] = leaf
        order.append(key)
    return flat, treedef, order


def _field_first(path: tuple[str, ...]) -> tuple:
    """Sort key: parameters first, then the optimizer state, then the step."""
    order = ("params", "opt_state", "step")
    return (order.index(path[0]) if path[0] in order else len(order), path)


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


def _unnest(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out = {}
    for k, v in tree.items():
        out.update(_unnest(v, (*prefix, str(k))))
    return out


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of a template leaf (an array or a ShapeDtypeStruct; without a
    sharding: this host's first device)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _like(restored: jax.Array, template: Any) -> jax.Array:
    """`restored`, uncommitted when the template leaf is an uncommitted (default-device) array:
    the jitted step compiles once for a resumed state, like for a fresh one."""
    if getattr(template, "_committed", True):
        return restored
    return jnp.asarray(np.asarray(restored))


def _scan_hint(missing: list[str], unexpected: list[str]) -> str:
    """Where one side has scanned layers and the other not: the model.scan_layers that reads
    the checkpoint."""

    def scanned(names: list[str]) -> bool:
        return any(STACK in name.split("/") for name in names)

    if scanned(unexpected) and not scanned(missing):
        return " (the checkpoint has scanned layers: set model.scan_layers=true)"
    if scanned(missing) and not scanned(unexpected):
        return " (the checkpoint has one set of parameters per layer: set model.scan_layers=false)"
    return ""


def _finite(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The metrics that are finite numbers, as floats."""
    numbers = {
        str(k): float(v)
        for k, v in (metrics or {}).items()
        if np.ndim(v) == 0 and not isinstance(v, str | bytes)
    }
    return {k: v for k, v in numbers.items() if math.isfinite(v)}


def _reach_emulator() -> None:
    """Where a GCS emulator is named (`STORAGE_EMULATOR_HOST`, as gcsfs reads it): points
    tensorstore's gcs driver, which writes the arrays, at it too, with a placeholder token (the
    emulator checks none; tensorstore would otherwise look for credentials, the metadata server
    included), and keeps gcsfs off the gRPC layout lookup that an emulator does not serve (read
    when gcsfs is imported). Settings already made are kept."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


def _directory(directory: str | os.PathLike) -> Path | epath.Path:
    """The checkpoint directory as orbax takes it: a local path made absolute, or a URL
    (`gs://...`: orbax writes there itself, the arrays through tensorstore)."""
    if is_url(directory):
        if os.fspath(directory).startswith("gs://"):
            _reach_emulator()
        return epath.Path(os.fspath(directory).rstrip("/"))
    return Path(directory).absolute()


def _move_objects(source: epath.Path, target: epath.Path) -> None:
    """Moves the folder `source` of an object store to `target`, object by object (a bucket has
    no folder rename; gcsfs's own move tries an API that emulators lack, then copies anyway).
    Everything is copied before anything is deleted, and the step's commit marker is deleted
    first: a move cut short leaves the step whole, or no longer a step (orbax then cleans it)."""
    fs = epath.backend.fsspec_backend.fs(os.fspath(source))
    root = os.fspath(source).partition("://")[2]
    names = fs.find(root)
    for name in names:
        fs.copy(name, os.fspath(target).partition("://")[2] + name[len(root) :])
    marker = f"{root}/{COMMIT_MARKER}"
    if marker in names:
        fs.rm_file(marker)
    fs.rm([n for n in names if n != marker])
    fs.invalidate_cache()


def _move(source: Path | epath.Path, target: Path | epath.Path) -> None:
    if is_url(source):
        _move_objects(source, target)
    else:
        source.rename(target)


class Checkpointer:
    """Saves and restores train states under `directory` (one sub-directory per step): a local
    path, or a gs:// URL that orbax writes to and reads from itself (tensorstore's gcs driver for
    the arrays, etils.epath over gcsfs for the rest).

    Keeps the last `max_to_keep` checkpoints plus the best one by `metrics[best_metric]`
    (`best_mode` "min" or "max"); checkpoints saved without a finite value of that metric are
    never the best."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        compress: bool = False,
    ):
        if best_mode not in BEST_MODES:
            raise ValueError(f"checkpoint best_mode must be 'min' or 'max', got {best_mode!r}")
        if max_to_keep < 1:
            raise ValueError(f"checkpoint max_to_keep must be at least 1, got {max_to_keep}")
        self.directory = _directory(directory)
        self.best_metric = best_metric
        self.passed_over: list[int] = []  # the corrupt steps the last restore went back from
        self.restored_step: int | None = None
        policies: list[Any] = [ocm.LatestN(n=max_to_keep)]
        best_fn = None
        if best_metric is not None:
            best_fn = lambda m: float(m[best_metric])  # noqa: E731
            policies.append(
                ocm.BestN(
                    get_metric_fn=best_fn,
                    reverse=best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            best_fn=best_fn,
            best_mode=best_mode,
            preservation_policy=ocm.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                STATE_ITEM: _StateHandler(compress),
                EXTRA_ITEM: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    # -- queries ----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps with a checkpoint, ascending (in this process: including saves still in
        flight; after a restart: only committed ones)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the best `best_metric`; None without `best_metric` or when no checkpoint
        was saved with that metric."""
        if self.best_metric is None:
            return None
        return self._manager.best_step()

    # -- save ---------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        extra: Mapping[str, Any],
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts saving `state`'s step, params and optimizer state plus the JSON dict `extra` as
        checkpoint `step` (asynchronously unless `async_save=False`; the state may be reused or
        donated as soon as this returns). `extra` goes through JSON (tuples come back as lists,
        keys as strings). Every process must call it. Returns False, saving nothing, when
        checkpoint `step` exists or, unless `force` (e.g. after rolling back), a later one does."""
        step = int(step)
        if step in self._manager.all_steps():
            log.info("checkpoint %d already exists in %s; not saved again", step, self.directory)
            return False
        latest = self.latest_step()
        if not force and latest is not None and step < latest:
            log.info("checkpoint %d is older than the latest (%d); not saved", step, latest)
            return False
        try:  # a copy, taken now: the caller may change `extra` while the save is in flight
            extra = json.loads(json.dumps(dict(extra), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from e
        tracked = _finite(metrics)
        if self.best_metric not in tracked:
            tracked = None  # never the best; orbax keeps it by recency only
        flat = _flat(state)[0]
        args = ocp.args.Composite(
            **{
                STATE_ITEM: _StateSave(_nest(flat)),
                EXTRA_ITEM: ocp.args.JsonSave(integrity.seal(extra, flat)),
            }
        )
        return bool(self._manager.save(step, args=args, metrics=tracked, force=True))

    def wait(self) -> None:
        """Blocks until every pending save is committed (durable on disk)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- restore ------------------------------------------------------------------------------

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} in {self.directory / str(step)}"

    def _corrupt(self, step: int, e: BaseException) -> CheckpointError:
        """The CheckpointError for a restore of `step` that raised `e`. An interruption (a
        signal, Ctrl-C) that the checkpoint library wrapped into its own error is no corruption:
        it is raised again as itself."""
        interrupted = interruption_in(e)
        if interrupted is not None:
            raise interrupted
        root = e
        while root.__cause__ is not None:  # the innermost cause says most (e.g. a missing file)
            root = root.__cause__
        detail = (str(root).strip().splitlines() or [""])[0].split(" See full ")[0][:300]
        others = [s for s in self.all_steps() if s != step]
        return CheckpointCorrupt(
            f"{self._where(step)} is unreadable or corrupt ({type(root).__name__}: {detail}); "
            f"delete it or restore another step (available: {others or 'none'})"
        )

    def _check_compatible(self, step: int, wanted: Mapping[tuple[str, ...], Any]) -> None:
        """Raises CheckpointError naming the parameter paths whose shapes (or presence) differ."""
        try:
            meta = self._manager.item_metadata(step)[STATE_ITEM]
            stored = _unnest(getattr(meta, "tree", meta))
            stored = {p: tuple(v.shape) for p, v in stored.items()}
        except Exception as e:
            raise self._corrupt(step, e) from e
        shapes, missing, unexpected = [], [], []
        for path in sorted(wanted.keys() | stored.keys(), key=_field_first):
            name = "/".join(path)
            if path not in stored:
                missing.append(name)
            elif path not in wanted:
                unexpected.append(name)
            elif stored[path] != tuple(wanted[path].shape):
                shapes.append(
                    f"{name} has shape {stored[path]} in the checkpoint, "
                    f"{tuple(wanted[path].shape)} in the model"
                )
        problems = shapes[:3] + [f"and {len(shapes) - 3} more shape mismatches"] * (len(shapes) > 3)
        for names, what in (
            (missing, "missing from the checkpoint"),
            (unexpected, "in the checkpoint but not in the model"),
        ):
            if names:
                more = f", ... ({len(names)} in all)" if len(names) > 2 else ""
                problems.append(f"{what}: {', '.join(names[:2])}{more}")
        if problems:
            raise CheckpointError(
                f"{self._where(step)} does not match the model (another model or config?): "
                + "; ".join(problems)
                + _scan_hint(missing, unexpected)
            )

    def _mismatch(self, step: int, problems: list[str]) -> CheckpointCorrupt:
        where = self.directory / str(step)
        files = [
            f"{where / EXTRA_ITEM}" if p == "extra" else f"{where / STATE_ITEM}" for p in problems
        ]
        shown = ", ".join(problems[:3]) + (
            f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        others = [s for s in self.all_steps() if s != step]
        return CheckpointCorrupt(
            f"{self._where(step)} fails its content checksums ({shown}): the files under "
            f"{', '.join(sorted(set(files)))} changed after the save (disk or copy corruption, "
            f"or an edit); delete it or restore another step (available: {others or 'none'})"
        )

    def _read(
        self, step: int, wanted: Mapping[tuple[str, ...], jax.ShapeDtypeStruct]
    ) -> tuple[dict[tuple[str, ...], jax.Array], dict[str, Any]]:
        """({path: restored array}, extra) of checkpoint `step`, its checksums verified."""
        self._check_compatible(step, wanted)
        args = ocp.args.Composite(
            **{
                STATE_ITEM: _StateRestore(_nest(wanted)),
                EXTRA_ITEM: ocp.args.JsonRestore(),
            }
        )
        failed: CheckpointCorrupt | None = None
        values, extra, problems, unchecked = {}, {}, [], []
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:
            failed = self._corrupt(step, e)
            failed.__cause__ = e
        else:
            values = _unnest(restored[STATE_ITEM])
            extra, record = integrity.unseal(dict(restored[EXTRA_ITEM] or {}))
            if record is None:
                log.info("%s holds no checksums (an earlier build saved it)", self._where(step))
            else:
                problems, unchecked = integrity.compare(record, extra, values)
        if jax.process_count() > 1:
            # One verdict for all: a process that raised while the others went on into their next
            # collective would hang the run. A read error on any process is every process's.
            mine = {"error": str(failed) if failed else "", "problems": problems}
            every = hosts.allgather_json(mine)
            errors = [v["error"] for v in every if v["error"]]
            if errors and (failed is None or str(failed) != errors[0]):
                raise CheckpointCorrupt(errors[0]) from failed
            problems = integrity.in_order([p for v in every for p in v["problems"]])
        if failed is not None:
            raise failed
        if unchecked:
            more = f", ... ({len(unchecked)} in all)" if len(unchecked) > 3 else ""
            log.info(
                "%s: %d arrays not checked (%s%s): the shards this process restored are not those "
                "their checksums were recorded for (another mesh or number of processes)",
                self._where(step),
                len(unchecked),
                ", ".join(unchecked[:3]),
                more,
            )
        if problems:
            raise self._mismatch(step, problems)
        return values, extra

    def _candidates(self, step: int | None, fallback: bool) -> list[int]:
        """The steps a restore tries, in order."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint to restore in {self.directory}")
            return steps[::-1] if fallback else steps[-1:]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint step {step} in {self.directory} (available: {steps or 'none'})"
            )
        return [step]

    def restore(
        self, state_template: TrainState, step: int | None = None, *, fallback: bool = False
    ) -> tuple[TrainState, dict[str, Any]]:
        """(state, extra) of checkpoint `step` (default: the latest). Arrays take the shapes,
        dtypes and shardings of `state_template` (arrays or ShapeDtypeStructs; each host reads
        only its shards); `frozen` and `ref` are the template's. Every process must call it.

        A step that cannot be read or fails its checksums raises `CheckpointCorrupt`; with
        `fallback` (and no `step` given) the restore goes back, with a warning, to the newest
        earlier step that verifies. The steps passed over are `passed_over` (newest first) and
        the step restored `restored_step`."""
        self.wait()
        candidates = self._candidates(step, fallback)
        flat, treedef, order = _flat(state_template)
        wanted = {path: _abstract(leaf) for path, leaf in flat.items()}
        self.passed_over, first_error = [], None
        for candidate in candidates:
            try:
                values, extra = self._read(candidate, wanted)
                break
            except CheckpointCorrupt as e:
                if first_error is None:
                    first_error = e
                if candidate == candidates[-1]:
                    if self.passed_over:
                        raise CheckpointCorrupt(
                            f"{first_error}; no earlier step verifies either (tried "
                            f"{', '.join(map(str, candidates))})"
                        ) from e
                    raise
                log.warning("%s; going back to an earlier step", e)
                self.passed_over.append(candidate)
        if self.passed_over:
            log.warning(
                "restored %s instead of the corrupt step(s) %s",
                self._where(candidate),
                ", ".join(map(str, self.passed_over)),
            )
        self.restored_step = candidate
        leaves = [_like(values[p], flat[p]) for p in order]
        tree = jax.tree_util.tree_unflatten(treedef, leaves)
        return state_template.replace(**tree), extra

    def set_aside(self, steps: list[int]) -> list[Path | epath.Path]:
        """Moves checkpoints `steps` (corrupt ones a fallback restore passed over) to
        `<step>.corrupt` beside them (process 0; every process must call it), out of the way of
        the saves that take those steps again; returns the new paths (process 0)."""
        moved = []
        for step in steps if jax.process_index() == 0 else []:
            target, n = self.directory / f"{step}.corrupt", 1
            while target.exists():
                n += 1
                target = self.directory / f"{step}.corrupt-{n}"
            _move(self.directory / str(step), target)
            log.warning("moved the corrupt checkpoint %d to %s", step, target)
            moved.append(target)
        hosts.barrier("dpojax checkpoints set aside")
        self._manager.reload()
        return moved
