"""Object-store workdirs (`gs://bucket/run`, `s3://...`): a job runs in a local mirror of the
bucket's folder and the mirror is copied back to the bucket as the run goes; for gs:// the
checkpoints are left out of the mirror, orbax writing and reading them in the bucket itself.

What the mirror carries, and why: orbax reaches gs:// by itself (etils.epath over gcsfs for its
files, tensorstore's gcs driver for the arrays), so a gs:// workdir's Checkpointer gets
`gs://bucket/run/checkpoints` (`checkpoint_dir`) and the mirror leaves `checkpoints/` alone. The
rest (config.json, metrics.jsonl, report.md, summary.json, export/, tensorboard/, evaluate/, the
token caches, ...) is written by code that takes local paths (open(), safetensors, tensorboard's
writer, the export of a model folder), so it stays on the mirror. For s3:// (orbax has no s3://
of its own) the mirror carries the checkpoints too.

`mirrored(url)` pulls the bucket's files into the mirror (`$DPOJAX_CACHE/workdirs/<scheme>/
<bucket>/<path>`, `~/.cache/dpojax` by default) and, while the job runs, `after_save()` pushes
what changed after every checkpoint save (for s3://, once the save is committed; checkpoints
still being written are left for the next push); when the job ends, however it ends (done,
stopped by a signal, failed), everything is pushed. A push uploads new and changed files and
deletes from the bucket the files the run deleted, so the bucket holds the mirrored files as
they were at the last push. Storage goes through fsspec: gcsfs for gs:// (the `gcs` extra),
s3fs for s3://; a scheme without an installed filesystem is refused before any compute.

The sync is ours, not fsspec's `fsspec.generic.rsync`: that one compares one field of both
listings (the size by default; a local file and a bucket object share no version field), so a
file rewritten at the same size (a config.json, a checkpoint's metadata) would not move either
way; and it neither leaves Orbax's temporary folders out nor sends commit markers last (the
bucket could show a checkpoint committed before its data). The bookkeeping here (each file's
bucket generation / etag and local size and mtime at the last pull or push, in STATE_FILE) is
what tells a change on either side from no change."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dpojax.errors import ConfigProblem, one_line
from dpojax.jobs.workdir import storage_notes
from dpojax.urls import COMMIT_MARKER, is_url

log = logging.getLogger(__name__)

# What the mirror remembers of each file at its last pull or push (not a workdir file).
STATE_FILE = ".dpojax-remote-sync.json"
# Orbax writes a checkpoint under a temporary name that it renames once committed, or in its
# step folder, writing COMMIT_MARKER into it last. A push after a save waits for the save to commit,
# leaves temporary folders out and sends commit markers last.
TMP_NAME = re.compile(r"\.orbax-checkpoint-tmp")
# The workdir folder of the checkpoints, and the schemes whose checkpoints orbax writes to the
# bucket itself (etils.epath and tensorstore's gcs driver): the mirror leaves that folder out.
CHECKPOINTS = "checkpoints"
NATIVE_SCHEMES = ("gs",)
# The pip package that provides each scheme's fsspec filesystem.
PACKAGES = {"gs": "gcsfs (pip install 'dpojax[gcs]')", "gcs": "gcsfs", "s3": "s3fs"}

_active: list[Mirror] = []


def joined(workdir: str | os.PathLike, name: str) -> str:
    """`name` inside `workdir`, for a message (a URL keeps its `scheme://`)."""
    if is_url(workdir):
        return f"{os.fspath(workdir).rstrip('/')}/{name}"
    return str(Path(workdir) / name)


def native_checkpoints(workdir: str | os.PathLike) -> bool:
    """True for a URL workdir whose checkpoints orbax reads and writes in the bucket itself."""
    return is_url(workdir) and os.fspath(workdir).partition("://")[0] in NATIVE_SCHEMES


def mirrored_out(rel: str) -> bool:
    """True for a workdir file (path relative to the workdir) that a native-checkpoint mirror
    does not carry: what orbax writes in the bucket itself."""
    return rel == CHECKPOINTS or rel.startswith(CHECKPOINTS + "/")


def checkpoint_dir(workdir: Path) -> Path | str:
    """Where a job running in `workdir` keeps its checkpoints: for the mirror of a gs:// workdir
    (while `mirrored` runs), the bucket's folder (orbax writes there itself); else
    `workdir/checkpoints`. A folder inside the mirror (a loop round's) keeps them in the mirror."""
    for mirror in _active:
        if mirror.native and Path(workdir) == mirror.local:
            return f"{mirror.url}/{CHECKPOINTS}"
    return Path(workdir) / CHECKPOINTS


def holds(workdir: str | os.PathLike, name: str) -> bool:
    """Whether the workdir holds `name` (a file or folder): in the bucket for what orbax writes
    there itself, else in the local folder (a URL's mirror)."""
    if native_checkpoints(workdir) and mirrored_out(name):
        url = joined(workdir, name)
        try:
            fs = filesystem(url)
            fs.invalidate_cache()  # orbax wrote them through another client
            return bool(fs.exists(fs._strip_protocol(url)))
        except (OSError, ConfigProblem):
            return False
    return (local_path(workdir) / name).exists()


def cache_root() -> Path:
    return Path(os.environ.get("DPOJAX_CACHE") or Path.home() / ".cache" / "dpojax")


def local_path(workdir: str | os.PathLike) -> Path:
    """The folder a job uses for `workdir`: the local mirror of a URL, else the path itself."""
    if not is_url(workdir):
        return Path(workdir)
    scheme, _, rest = os.fspath(workdir).partition("://")
    parts = [p for p in rest.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ConfigProblem(
            f"--workdir {workdir}: name a bucket and a folder, e.g. gs://bucket/run"
        )
    return cache_root() / "workdirs" / scheme / Path(*parts)


def check(workdir: str | os.PathLike) -> None:
    """Raises `ConfigProblem`, before any compute, for a URL workdir that names no folder or
    whose scheme has no storage library installed (nothing for a local path)."""
    if is_url(workdir):
        local_path(workdir)
        _check_credentials(os.fspath(workdir))  # first: gcsfs looks for them when it starts
        filesystem(os.fspath(workdir))


def _check_credentials(url: str) -> None:
    problem = storage_notes.check_credentials(url)
    if problem:
        raise ConfigProblem(f"--workdir {url}: {problem}")


def filesystem(url: str) -> Any:
    """The fsspec filesystem for `url`'s scheme; `ConfigProblem` naming the package to install
    when there is none."""
    scheme = url.partition("://")[0]
    # gRPC's own log lines (gcsfs asks a bucket's layout over gRPC) only from errors on
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        # An emulator serves the JSON API only: gcsfs's default class would wait 60 s per bucket
        # for a gRPC layout lookup. Read when gcsfs is imported, so before the first gs:// use.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        import fsspec

        return fsspec.filesystem(scheme)
    except ImportError as e:
        package = PACKAGES.get(scheme, f"the fsspec filesystem for {scheme}://")
        raise ConfigProblem(
            f"--workdir {url}: {scheme}:// workdirs need {package} ({one_line(e)}); install it, "
            "or give a local path"
        ) from None
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ConfigProblem(
            f"--workdir {url}: no storage library handles {scheme}:// ({one_line(e)}); give a "
            "gs:// or s3:// URL or a local path"
        ) from None


def _key(info: dict[str, Any]) -> str:
    """What changes when a bucket's object changes (its version tag, else size and time)."""
    for name in ("generation", "etag", "ETag", "md5Hash"):
        if info.get(name):
            return f"{name}:{info[name]}"
    return f"size:{info.get('size')}:{info.get('mtime') or info.get('LastModified')}"


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


class Mirror:
    """The local copy of the workdir `url` in `local`, with what it knows of each file:
    {relative path: {"remote": key in the bucket, "local": [size, mtime_ns]}}. For a gs:// URL
    the copy leaves out `checkpoints/` (`native`): orbax writes and reads those in the bucket."""

    def __init__(self, url: str, local: Path, fs: Any):
        self.url, self.local, self.fs = url.rstrip("/"), local, fs
        self.native = native_checkpoints(self.url)
        self.root = fs._strip_protocol(self.url).rstrip("/")
        try:
            self.known = json.loads((local / STATE_FILE).read_text())
        except (OSError, ValueError):
            self.known = {}

    def _carried(self, rel: str) -> bool:
        return not (self.native and mirrored_out(rel))

    def _remote_files(self) -> dict[str, dict[str, Any]]:
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        prefix = self.root + "/"
        return {
            name[len(prefix) :]: info
            for name, info in found.items()
            if name.startswith(prefix)
            and info.get("type", "file") == "file"
            and self._carried(name[len(prefix) :])
        }

    def _local_files(self) -> dict[str, Path]:
        if not self.local.is_dir():
            return {}
        return {
            p.relative_to(self.local).as_posix(): p
            for p in self.local.rglob("*")
            if p.is_file()
            and p.name != STATE_FILE
            and self._carried(p.relative_to(self.local).as_posix())
        }

    def _save_state(self) -> None:
        tmp = self.local / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.known))
        tmp.replace(self.local / STATE_FILE)

    def pull(self) -> int:
        """Makes the mirror the bucket's copy: downloads the files it lacks or that changed in the
        bucket, deletes those the bucket does not hold. Returns the number downloaded."""
        remote, local = self._remote_files(), self._local_files()
        self.local.mkdir(parents=True, exist_ok=True)
        for rel, path in local.items():
            if rel not in remote:
                path.unlink()
                self.known.pop(rel, None)
        fetched = 0
        for rel, info in remote.items():
            path, known = self.local / rel, self.known.get(rel, {})
            fresh = path.is_file() and known.get("remote") == _key(info)
            if fresh and known.get("local") == _stat(path):
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(f"{self.root}/{rel}", str(path))
            self.known[rel] = {"remote": _key(info), "local": _stat(path)}
            fetched += 1
        self.known = {rel: v for rel, v in self.known.items() if rel in remote}
        self._save_state()
        return fetched

    def push(self) -> int:
        """Copies the mirror to the bucket: uploads new and changed files (not checkpoints still
        being written), deletes the bucket's files the run deleted. Returns the number uploaded."""
        local = {r: p for r, p in self._local_files().items() if not TMP_NAME.search(r)}
        sent: dict[str, list[int]] = {}
        # commit markers last: the bucket never shows a checkpoint as committed before its data
        for rel in sorted(local, key=lambda r: r.endswith(COMMIT_MARKER)):
            stat = _stat(local[rel])
            if self.known.get(rel, {}).get("local") != stat:
                self.fs.put_file(str(local[rel]), f"{self.root}/{rel}")
                sent[rel] = stat
        gone = [rel for rel in self.known if rel not in local and self._carried(rel)]
        for rel in gone:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.root}/{rel}")
            del self.known[rel]
        if sent:
            self.fs.invalidate_cache(self.root)
            remote = self._remote_files()
            for rel, stat in sent.items():  # a file that changed while it went up goes again
                self.known[rel] = {"remote": _key(remote.get(rel, {})), "local": stat}
        self._save_state()
        if sent or gone:
            log.info("%s: %d file(s) uploaded, %d deleted", self.url, len(sent), len(gone))
        return len(sent)


def _pulled_mirror(url: str) -> Mirror:
    _check_credentials(url)
    mirror = Mirror(url, local_path(url), filesystem(url))
    try:
        count = mirror.pull()
    except OSError as e:
        raise ConfigProblem(f"--workdir {url}: cannot read the bucket: {one_line(e)}") from None
    log.info("%s: %d file(s) downloaded to %s", url, count, mirror.local)
    return mirror


def pulled(url: str) -> Path:
    """Pulls the workdir `url` into its mirror; returns the mirror's path."""
    with storage_notes.quiet_storage_logs(url):
        return _pulled_mirror(url).local


@contextlib.contextmanager
def mirrored(workdir: str | os.PathLike, *, processes: int = 1) -> Iterator[Path]:
    """The local folder a job runs in for `workdir`: the path itself, or for a URL the mirror,
    pulled now and pushed after checkpoint saves (`after_save`) and when the job ends."""
    if not is_url(workdir):
        yield Path(workdir)
        return
    url = os.fspath(workdir)
    if processes > 1:
        raise ConfigProblem(
            f"--workdir {url}: object-store workdirs work for single-process runs; over "
            f"{processes} processes give a folder that every process shares (e.g. a gcsfuse mount)"
        )
    with storage_notes.quiet_storage_logs(url):
        mirror = _pulled_mirror(url)
        _active.append(mirror)
        try:
            yield mirror.local
        except BaseException:
            _push_or_warn(mirror)  # the job's own error is the one to report
            raise
        finally:
            _active.remove(mirror)
        mirror.push()


def _push_or_warn(mirror: Mirror) -> None:
    try:
        mirror.push()
    except Exception as e:  # noqa: BLE001 - any storage error: the next push tries again
        log.warning("%s: push failed (%s); the next push retries", mirror.url, one_line(e))


def after_save(wait: Callable[[], None]) -> None:
    """For a job whose workdir is an object store: pushes the mirror to the bucket, first
    calling `wait` (which returns once the checkpoint just started is committed). The mirror
    may carry checkpoints even for gs://: s3:// workdirs, and a loop round's folder inside the
    mirror (only the workdir's own checkpoints/ go to the bucket through orbax), so the wait is
    kept for every URL. Nothing for a local workdir."""
    if _active:
        wait()
    for mirror in _active:  # a failed upload does not stop training: the next push retries
        _push_or_warn(mirror)
