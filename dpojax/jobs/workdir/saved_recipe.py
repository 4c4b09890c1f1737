"""The recipe file behind a saved config on the command line: `--config=WORKDIR/config.json`
(or a .yaml file, or a run's workdir, or no --config with a --workdir that holds a run) is
loaded as `--config=<this file>:<that path>`, so `--config.<key>=<value>` overrides apply on top
as they do to a recipe (`dpojax.main`)."""

from __future__ import annotations

import ml_collections

from dpojax.jobs.workdir import saved_config


def get_config(source: str) -> ml_collections.ConfigDict:
    return saved_config(source)
