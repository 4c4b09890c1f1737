"""gs:// workdirs (dpojax.jobs.workdir.remote) against a GCS emulator on 127.0.0.1: the mirror's pull
and push, what a push leaves out and deletes, and the errors for what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpojax.config import frozen
from dpojax.errors import ConfigProblem
from dpojax.jobs.workdir import remote
from tests.helpers.gcs_emulator import gcs_bucket  # noqa: F401 - the fixture


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DPOJAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_local_paths_are_left_alone_and_urls_get_a_mirror(cache):
    assert not remote.is_url("runs/a:b") and remote.is_url("gs://b/run")
    assert remote.local_path("runs/x") == Path("runs/x")
    assert remote.local_path("gs://bkt/a/run/") == cache / "workdirs" / "gs" / "bkt" / "a" / "run"
    assert remote.joined("gs://bkt/run/", "export") == "gs://bkt/run/export"
    with pytest.raises(ConfigProblem, match="name a bucket and a folder"):
        remote.check("gs://")
    with pytest.raises(ConfigProblem, match="nosuch://"):
        remote.check("nosuch://bkt/run")
    with remote.mirrored("plain/dir") as local:
        assert local == Path("plain/dir")


def test_a_scheme_whose_library_is_missing_names_the_package(cache, monkeypatch):
    import fsspec

    def missing(scheme, **_):
        raise ImportError(f"Install s3fs to access {scheme}")

    monkeypatch.setattr(fsspec, "filesystem", missing)
    with pytest.raises(ConfigProblem, match=r"s3:// workdirs need s3fs"):
        remote.check("s3://bkt/run")


def test_push_and_pull_mirror_the_bucket(cache, gcs_bucket, monkeypatch):  # noqa: F811
    # The mirror as an s3:// workdir has it, checkpoints included (gs:// leaves them to orbax).
    monkeypatch.setattr(remote, "NATIVE_SCHEMES", ())
    url = f"gs://{gcs_bucket.bucket}/runs/one"
    with remote.mirrored(url) as local:
        assert local == remote.local_path(url) and [p.name for p in local.iterdir()] == [
            remote.STATE_FILE
        ]
        (local / "checkpoints" / "2").mkdir(parents=True)
        (local / "checkpoints" / "2" / "state").write_bytes(b"\x00" * 3_000_000)
        (local / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()
        (local / "checkpoints" / "4.orbax-checkpoint-tmp-1" / "state").write_text("half")
        (local / "metrics.jsonl").write_text('{"step": 1}\n')
        waited = []
        remote.after_save(lambda: waited.append(1))
        assert waited == [1]
        # a checkpoint still being written stays local; the committed one is in the bucket
        assert set(gcs_bucket.files("runs/one")) == {"checkpoints/2/state", "metrics.jsonl"}
        (local / "checkpoints" / "4.orbax-checkpoint-tmp-1").rename(local / "checkpoints" / "4")
        (local / "checkpoints" / "2" / "state").unlink()  # max_to_keep dropped step 2
        (local / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    files = gcs_bucket.files("runs/one")
    assert files == {"checkpoints/4/state": b"half", "metrics.jsonl": b'{"step": 1}\n{"step": 2}\n'}
    remote.after_save(pytest.fail)  # no job: nothing to push, nothing fails

    # Another machine (an empty cache) resumes from the bucket alone.
    (cache / "workdirs").rename(cache / "old")
    local = remote.pulled(url)
    assert (local / "checkpoints" / "4" / "state").read_text() == "half"
    assert (local / "metrics.jsonl").read_text().count("step") == 2
    # The bucket changed under the mirror: a pull fetches what changed and drops what went.
    gcs_bucket.fs.pipe(f"{gcs_bucket.bucket}/runs/one/metrics.jsonl", b"new\n")
    gcs_bucket.fs.rm(f"{gcs_bucket.bucket}/runs/one/checkpoints/4/state")
    gcs_bucket.fs.invalidate_cache()
    mirror = remote.Mirror(url, local, remote.filesystem(url))
    assert mirror.pull() == 1
    assert (local / "metrics.jsonl").read_text() == "new\n"
    assert not (local / "checkpoints" / "4" / "state").exists()
    assert mirror.pull() == 0  # nothing changed since: nothing downloaded
    assert mirror.push() == 0


def test_a_gs_mirror_leaves_the_checkpoints_to_orbax_in_the_bucket(cache, gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/runs/native"
    bucket_ckpt = f"{gcs_bucket.bucket}/runs/native/checkpoints/3/commit_success.txt"
    gcs_bucket.fs.pipe(bucket_ckpt, b"orbax wrote it")
    gcs_bucket.fs.invalidate_cache()
    assert remote.checkpoint_dir(Path("x")) == Path("x") / "checkpoints"
    with remote.mirrored(url) as local:
        assert remote.checkpoint_dir(local) == f"{url}/checkpoints"
        assert remote.checkpoint_dir(local / "round_1") == local / "round_1" / "checkpoints"
        assert not (local / "checkpoints").exists()  # not downloaded
        (local / "checkpoints" / "7").mkdir(parents=True)  # an older build's local copy
        (local / "checkpoints" / "7" / "state").write_text("old")
        (local / "metrics.jsonl").write_text("1\n")
        remote.after_save(lambda: None)  # waits for the save (a round's may be in the mirror)
        assert gcs_bucket.files("runs/native") == {
            "checkpoints/3/commit_success.txt": b"orbax wrote it",
            "metrics.jsonl": b"1\n",
        }
        (local / "checkpoints" / "7" / "state").unlink()
    # neither uploaded nor deleted by the mirror; the outputs line finds them in the bucket
    assert set(gcs_bucket.files("runs/native")) == {
        "checkpoints/3/commit_success.txt",
        "metrics.jsonl",
    }
    assert remote.holds(url, "checkpoints") and remote.holds(url, "metrics.jsonl")
    assert not remote.holds(url, "export")
    assert remote.checkpoint_dir(remote.local_path(url)) == remote.local_path(url) / "checkpoints"


def test_a_job_that_fails_still_pushes_what_it_wrote(cache, gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/runs/two"
    with pytest.raises(RuntimeError), remote.mirrored(url) as local:
        (local / "summary.json").write_text("{}")
        raise RuntimeError("the job failed")
    assert gcs_bucket.files("runs/two") == {"summary.json": b"{}"}
    with pytest.raises(ConfigProblem, match="single-process"), remote.mirrored(url, processes=2):
        pass


def test_the_python_api_reads_a_gs_workdir_from_the_bucket(cache, gcs_bucket):  # noqa: F811
    from dpojax import api

    url = f"gs://{gcs_bucket.bucket}/runs/api"
    gcs_bucket.fs.pipe(
        f"{gcs_bucket.bucket}/runs/api/metrics.jsonl", b'{"step": 1, "split": "train"}\n'
    )
    gcs_bucket.fs.invalidate_cache()
    assert list(api.metrics(url)) == [{"step": 1, "split": "train"}]
    with pytest.raises(ConfigProblem, match=f"{url} holds no config.json"):
        api.evaluate(url)


def test_a_failed_push_after_a_save_warns_and_the_next_push_sends_it(cache, gcs_bucket, caplog):  # noqa: F811
    url = f"gs://{gcs_bucket.bucket}/runs/flaky"
    with remote.mirrored(url) as local:
        mirror = remote._active[-1]
        (local / "metrics.jsonl").write_text("1\n")
        real, calls = mirror.fs.put_file, []

        def flaky(*args, **kwargs):
            calls.append(args)
            if len(calls) == 1:
                raise OSError("503 Service Unavailable")
            return real(*args, **kwargs)

        mirror.fs.put_file = flaky
        remote.after_save(lambda: None)
        assert "push failed (503 Service Unavailable); the next push retries" in caplog.text
        assert gcs_bucket.files("runs/flaky") == {}
    assert gcs_bucket.files("runs/flaky") == {"metrics.jsonl": b"1\n"}


def test_the_command_line_starts_from_a_gs_workdirs_config(cache, gcs_bucket, tmp_path):  # noqa: F811
    from dpojax.cli import argv as argv_rewrite
    from dpojax.config import default_config
    from dpojax.jobs.workdir import check_config, saved_recipe

    url = f"gs://{gcs_bucket.bucket}/runs/cli"
    with remote.mirrored(url) as local:
        check_config(frozen(default_config()), local, resuming=False)  # writes config.json
    recipe, mirror = saved_recipe.__file__, str(remote.local_path(url))
    (cache / "workdirs").rename(cache / "old")  # another machine
    argv = ["dpojax", f"--workdir={url}", "--config.mode=export"]
    assert argv_rewrite.with_saved_config(argv) == [
        "dpojax",
        f"--config={recipe}:{mirror}",
        *argv[1:],
    ]
    argv = ["dpojax", f"--config={url}", "--workdir=elsewhere"]
    assert argv_rewrite.with_saved_config(argv) == [
        "dpojax",
        f"--config={recipe}:{mirror}",
        argv[2],
    ]
