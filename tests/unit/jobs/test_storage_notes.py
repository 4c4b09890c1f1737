"""dpojax.jobs.workdir.storage_notes: a gs:// workdir without credentials stops at once with how to give
some, and the storage library's per-request warnings become one summary line per kind."""

from __future__ import annotations

import logging
import time

import pytest

from dpojax.errors import ConfigProblem
from dpojax.jobs.workdir import remote, storage_notes
from dpojax.jobs.workdir.storage_notes import CREDENTIALS_HINT, credentials_problem


def test_no_credential_source_gets_the_hint(tmp_path):
    assert credentials_problem("gs", {}, tmp_path, on_gce=False) == CREDENTIALS_HINT
    assert "gcloud auth application-default login" in CREDENTIALS_HINT
    assert "GOOGLE_APPLICATION_CREDENTIALS" in CREDENTIALS_HINT


@pytest.mark.parametrize(
    "env, on_gce, token",
    [
        ({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9023"}, False, None),
        ({"FSSPEC_GS_TOKEN": "anon"}, False, None),
        ({}, False, "anon"),
        ({"GCE_METADATA_HOST": "metadata.internal"}, False, None),
        ({}, True, None),
    ],
)
def test_each_credential_source_is_enough(tmp_path, env, on_gce, token):
    assert credentials_problem("gs", env, tmp_path, on_gce=on_gce, token=token) is None


def test_gcloud_adc_file_and_key_file(tmp_path):
    adc = tmp_path / ".config" / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir(parents=True)
    adc.write_text("{}")
    assert credentials_problem("gs", {}, tmp_path, on_gce=False) is None
    other = tmp_path / "elsewhere"
    assert credentials_problem("gs", {"CLOUDSDK_CONFIG": str(other)}, tmp_path, False)
    missing = str(tmp_path / "key.json")
    problem = credentials_problem(
        "gs", {"GOOGLE_APPLICATION_CREDENTIALS": missing}, tmp_path, False
    )
    assert problem and missing in problem and "not a file" in problem
    assert credentials_problem("s3", {}, tmp_path, on_gce=False) is None


def test_a_gs_workdir_without_credentials_fails_fast_with_the_hint(tmp_path, monkeypatch):
    for name in (
        "STORAGE_EMULATOR_HOST",
        "FSSPEC_GS_TOKEN",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GCE_METADATA_HOST",
        "CLOUDSDK_CONFIG",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DPOJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(storage_notes, "metadata_server_reachable", lambda: False)
    import fsspec

    monkeypatch.setitem(fsspec.config.conf, "gs", {})
    start = time.monotonic()
    with pytest.raises(ConfigProblem, match="gcloud auth application-default login") as err:
        remote.check("gs://bucket/run")
    assert time.monotonic() - start < 1  # before gcsfs starts (it would look for a minute)
    assert str(err.value).startswith("--workdir gs://bucket/run: gs:// workdirs need")


def test_storage_warnings_become_one_line_per_kind(caplog):
    caplog.set_level(logging.DEBUG)
    with storage_notes.quiet_storage_logs("gs://b/run"):
        for n in range(40):
            logging.getLogger("gcsfs").warning("Could not determine bucket type for b%d", n)
        for _ in range(3):
            logging.getLogger("gcsfs.credentials").warning("retrying the token")
        logging.getLogger("fsspec").info("not a warning")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["dpojax.jobs.workdir.remote"] * 2
    assert "warned 40 time(s): gcsfs: Could not determine bucket type for b0" in warnings[0].message
    assert "warned 3 time(s): gcsfs.credentials: retrying the token" in warnings[1].message
    assert logging.getLogger("gcsfs").propagate  # restored
    with storage_notes.quiet_storage_logs("gs://b/run"):
        pass
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2
