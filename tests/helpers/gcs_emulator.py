"""A Google Cloud Storage emulator on 127.0.0.1 (gcp-storage-emulator's in-memory server) that
gcsfs talks to through `STORAGE_EMULATOR_HOST`, for the gs:// workdir tests.

`gcs_bucket` (a fixture) starts the server with an empty bucket and yields `GcsEmulator`: the
bucket's name, `env` (what a subprocess needs to reach the emulator and nothing else), `fs` (a
gcsfs filesystem on it). The tests are skipped, naming the package, where gcsfs or the emulator
is not installed (both come with the `test` extra)."""

from __future__ import annotations

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


@pytest.fixture
def gcs_bucket(monkeypatch) -> Iterator[GcsEmulator]:
    pytest.importorskip("gcsfs", reason="gs:// workdirs need gcsfs (the gcs extra)")
    server_module = pytest.importorskip(
        "gcp_storage_emulator.server", reason="the GCS emulator: pip install gcp-storage-emulator"
    )
    import fsspec
    import gcsfs.core
    from fsspec.registry import _registry

    port = _free_port()
    server = server_module.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
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
    monkeypatch.setitem(_registry, "gs", gcsfs.core.GCSFileSystem)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    try:
        yield GcsEmulator(BUCKET, env, fsspec.filesystem("gs"))
    finally:
        gcsfs.core.GCSFileSystem.clear_instance_cache()
        server.stop()
