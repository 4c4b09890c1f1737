"""A Google Cloud Storage emulator on 127.0.0.1 (gcp-storage-emulator's in-memory server) that
gcsfs talks to through `STORAGE_EMULATOR_HOST`, for the gs:// workdir tests.

`gcs_bucket` (a fixture) starts the server with an empty bucket and yields `GcsEmulator`: the
bucket's name, `env` (what a subprocess needs to reach the emulator and nothing else), `fs` (a
gcsfs filesystem on it). The tests are skipped, naming the package, where gcsfs or the emulator
is not installed (both come with the `test` extra).

One server serves every test of a process, its bucket emptied for each: tensorstore (orbax's
array writer) and etils.epath's cached gcsfs keep the address they first reached, so a server
on a new port per test would leave them talking to a stopped one."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "dpojax-test"


@dataclass
class GcsEmulator:
    bucket: str
    env: dict[str, str]
    fs: Any

    def files(self, folder: str) -> dict[str, bytes]:
        """{path under gs://bucket/folder: contents} of every object there."""
        root = f"{self.bucket}/{folder}".rstrip("/")
        self.fs.invalidate_cache()
        return {name[len(root) + 1 :]: self.fs.cat_file(name) for name in self.fs.find(root)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensorstore_downloads(server_module) -> None:
    """Makes the emulator's object downloads answer as GCS does where tensorstore (orbax's array
    writer) relies on it: the object's generation in an `x-goog-generation` header (without it
    tensorstore fails the read with "Malformed StorageGeneration") and 304 Not Modified for a
    read `ifGenerationNotMatch` the current generation (the emulator ignores the condition and
    sends the object). Tensorstore's OCDBT re-reads its manifest that way while it writes."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    if getattr(original, "for_tensorstore", False):
        return

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return original(request, response, storage, *args, **kwargs)
        generation = str(obj.get("generation"))
        response["x-goog-generation"] = generation
        if (request.query.get("ifGenerationNotMatch") or [None])[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        return original(request, response, storage, *args, **kwargs)

    download.for_tensorstore = True
    objects.download = download  # objects.get (the ?alt=media reads) calls it by name
    for _, methods in server_module.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = download


_server: list[Any] = []  # the process's server and its port, started by the first test


def _started(server_module, config=None) -> tuple[Any, int]:
    """The process's server and port, started on the first call (stopped when pytest ends)."""
    if not _server:
        _tensorstore_downloads(server_module)
        port = _free_port()
        server = server_module.create_server(
            "127.0.0.1", port, in_memory=True, default_bucket=BUCKET
        )
        server.start()
        # Its own logs: each object a reader probes for and does not find, as an ERROR line.
        logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
        _server.extend([server, port])
        if config is not None:
            config.add_cleanup(server.stop)
    return _server[0], _server[1]


def _forget_listings() -> None:
    """Drops what gcsfs instances remember of the bucket (etils.epath keeps its own instance)."""
    import gcsfs.core
    from etils import epath

    epath.backend.fsspec_backend.fs("gs://x").invalidate_cache()
    gcsfs.core.GCSFileSystem.clear_instance_cache()


@pytest.fixture
def gcs_bucket(monkeypatch, request) -> Iterator[GcsEmulator]:
    pytest.importorskip("gcsfs", reason="gs:// workdirs need gcsfs (the gcs extra)")
    server_module = pytest.importorskip(
        "gcp_storage_emulator.server", reason="the GCS emulator: pip install gcp-storage-emulator"
    )
    import fsspec
    import gcsfs.core
    from fsspec.registry import _registry

    server, port = _started(server_module, request.config)
    server.wipe(keep_buckets=True)
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        # No credentials: gcsfs would otherwise look for them (the metadata server included).
        "FSSPEC_GS_TOKEN": "anon",
        # gcsfs's default class asks the gRPC storage-control API for each bucket's layout,
        # which the emulator does not serve; the JSON API class is what dpojax needs.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
    for scheme in ("gs", "gcs"):  # etils.epath (orbax's paths) asks for "gcs"
        monkeypatch.setitem(_registry, scheme, gcsfs.core.GCSFileSystem)
    _forget_listings()
    try:
        yield GcsEmulator(BUCKET, env, fsspec.filesystem("gs"))
    finally:
        _forget_listings()
