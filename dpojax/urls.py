"""Storage named by URL, as both the checkpoints (`dpojax.train.checkpoint`, which orbax writes
to gs:// itself) and the object-store workdirs (`dpojax.jobs.workdir.remote`) read it. A leaf: importing
it imports nothing else of dpojax, nor JAX."""

from __future__ import annotations

import os

# What orbax writes last into a checkpoint's folder (on GCS and on a local disk alike): a step
# folder without it is unfinished.
COMMIT_MARKER = "commit_success.txt"


def is_url(location: str | os.PathLike) -> bool:
    """True for a location named by a URL (`scheme://...`), not a local path."""
    scheme, sep, _ = os.fspath(location).partition("://")
    return bool(sep and scheme and scheme.replace("+", "").isalnum())
