"""What an object-store workdir tells the user: a credentials check before the first request,
and the storage library's warnings as one summary line instead of one line per file.

- `credentials_problem` finds, without a network request, whether gcsfs has any credentials to
  use (the sources google-auth tries, in its order) and says how to give some where there are
  none. Without it gcsfs tries each source in turn, the VM metadata server with retries
  included, and fails about a minute later with "cannot connect" and no word of credentials.
- `quiet_storage_logs` collects the WARNING records of gcsfs and fsspec (gcsfs warns per
  request, e.g. for each bucket-layout lookup that fails) while a workdir is mirrored, and logs
  one line per kind at the end with its count and first text (`-v` shows every record).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

log = logging.getLogger("dpojax.jobs.workdir.remote")

STORAGE_LOGGERS = ("gcsfs", "fsspec")
GCS_SCHEMES = ("gs", "gcs")
METADATA_ADDRESS = ("169.254.169.254", 80)  # a Google Cloud VM's metadata server
CREDENTIALS_HINT = (
    "gs:// workdirs need Google Cloud credentials and none were found: run `gcloud auth "
    "application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key "
    "file, or run on a Google Cloud VM with a service account; FSSPEC_GS_TOKEN=anon reads public "
    "buckets, and STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT points at a local emulator "
    "(docs/cloud_workdirs.md)"
)


def _adc_file(env: Mapping[str, str], home: Path) -> Path:
    """gcloud's application-default credentials file."""
    config = env.get("CLOUDSDK_CONFIG") or str(home / ".config" / "gcloud")
    return Path(config) / "application_default_credentials.json"


def credentials_problem(
    scheme: str, env: Mapping[str, str], home: Path, on_gce: bool, token: object = None
) -> str | None:
    """None when gcsfs has credentials to try for `scheme` (or the scheme is not GCS's), else
    what is missing and how to give it. `token`: fsspec's configured `gs` token, if any."""
    if scheme not in GCS_SCHEMES:
        return None
    key_file = env.get("GOOGLE_APPLICATION_CREDENTIALS")
    if key_file and not Path(key_file).is_file():
        return (
            f"GOOGLE_APPLICATION_CREDENTIALS names {key_file}, which is not a file: point it at "
            "a service-account key file, or unset it"
        )
    found = (
        env.get("STORAGE_EMULATOR_HOST"),
        env.get("FSSPEC_GS_TOKEN"),
        token,
        key_file,
        env.get("GCE_METADATA_HOST"),
        _adc_file(env, home).is_file(),
        on_gce,
    )
    return None if any(found) else CREDENTIALS_HINT


def metadata_server_reachable(timeout: float = 0.3) -> bool:
    """Whether a Google Cloud VM's metadata server answers a TCP connection, quickly."""
    try:
        with socket.create_connection(METADATA_ADDRESS, timeout=timeout):
            return True
    except OSError:
        return False


def check_credentials(url: str) -> str | None:
    """`credentials_problem` for this process's environment."""
    scheme = url.partition("://")[0]
    if scheme not in GCS_SCHEMES:
        return None
    try:
        import fsspec

        token = fsspec.config.conf.get(scheme, {}).get("token")
    except ImportError:
        token = None
    env, home = os.environ, Path.home()
    problem = credentials_problem(scheme, env, home, on_gce=False, token=token)
    if problem == CREDENTIALS_HINT and metadata_server_reachable():
        return None  # only now the network: most hosts have credentials of another kind
    return problem


def _kind(message: str) -> str:
    """A record's text with its numbers and quoted names blanked, to count alike ones."""
    return re.sub(r"\d+", "N", message)[:160]


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0] if record.getMessage() else ""
        kind = f"{record.name}: {_kind(message)}"
        self.counts[kind] += 1
        self.first.setdefault(kind, f"{record.name}: {message[:300]}")
        log.debug("%s: %s", record.name, record.getMessage())


def summary_lines(url: str, counts: Counter, first: Mapping[str, str]) -> list[str]:
    """One line per kind of warning, the most frequent first."""
    return [
        f"{url}: the storage library warned {count} time(s): {first[kind]}"
        for kind, count in counts.most_common()
    ]


@contextlib.contextmanager
def quiet_storage_logs(url: str) -> Iterator[None]:
    """Holds back the storage libraries' warnings for the block; logs their summary after it."""
    collector = _Collector()
    loggers = [logging.getLogger(name) for name in STORAGE_LOGGERS]
    saved = [(lg, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(collector)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in saved:
            lg.removeHandler(collector)
            lg.propagate = propagate
        for line in summary_lines(url, collector.counts, collector.first):
            log.warning("%s", line)
