"""The command line's argv rewriting before absl parses it: a shipped recipe named by its name,
a saved config (a run's config.json, a .yaml file, a workdir, also in a bucket) loaded through
`dpojax.jobs.workdir.saved_recipe` (`dpojax.main`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dpojax.errors import EXIT_CONFIG, ConfigErrors, ConfigProblem, one_line

# --workdir's default (`dpojax.main`).
DEFAULT_WORKDIR = "runs/default"


def flag_value(argv: list[str], name: str) -> tuple[int, int, str] | None:
    """(first index, last index + 1, value) of the last `--name=value` or `--name value`."""
    found = None
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith(f"--{name}="):
            found = (i, i + 1, arg.split("=", 1)[1])
        elif arg == f"--{name}" and i + 1 < len(argv):
            found = (i, i + 2, argv[i + 1])
    return found


def check_saved(source: str) -> None:
    """Exits with one line per problem of the saved config `source` (the flag parser would wrap
    them in the loader's traceback)."""
    from dpojax.jobs.workdir import saved_config

    try:
        saved_config(source)
    except ConfigErrors as e:
        for line in e.errors:
            print(f"dpojax: error: {line}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def pulled(workdir: str) -> str:
    """`workdir`, or for an object-store URL the local mirror it is pulled into (where its
    config.json is read from)."""
    from dpojax.jobs.workdir import remote

    if not remote.is_url(workdir):
        return workdir
    try:
        return str(remote.pulled(workdir))
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def with_recipe_name(argv: list[str]) -> list[str]:
    """`argv` with a --config that names a shipped recipe (`--config train_pairs`, also with
    `:ARG`) given as its file (`dpojax.config.recipes`); a path that exists wins. Exits with the
    shipped names for a bare name or a `.py` file that is neither."""
    from dpojax.config import recipes

    given = flag_value(argv, "config")
    if given is None:
        return argv
    start, end, value = given
    if "://" in value:  # a run's workdir in a bucket (`with_saved_config`)
        return argv
    name, colon, arg = value.partition(":")
    try:
        path = recipes.source(name)
    except ConfigProblem as e:
        print(f"dpojax: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if path == Path(name):
        return argv
    return [*argv[:start], f"--config={path}{colon}{arg}", *argv[end:]]


def with_saved_config(argv: list[str]) -> list[str]:
    """`argv` with a saved config loaded as a recipe (`dpojax.jobs.workdir.saved_recipe`): the file or
    workdir that --config names when it is no recipe (.json, .yaml, .yml, a directory), or,
    without --config, the --workdir's config.json when it holds a run."""
    from dpojax.jobs.workdir import CONFIG_FILE, SAVED_SUFFIXES, saved_recipe

    recipe = saved_recipe.__file__
    given = flag_value(argv, "config")
    if given is not None:
        start, end, value = given
        value = pulled(value)  # a run's workdir in a bucket: its local mirror
        if value.endswith(SAVED_SUFFIXES) or os.path.isdir(value):
            check_saved(value)
            return [*argv[:start], f"--config={recipe}:{value}", *argv[end:]]
        return argv
    workdir = (flag_value(argv, "workdir") or (0, 0, DEFAULT_WORKDIR))[2]
    workdir = pulled(workdir)
    if not os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
        return argv
    check_saved(workdir)
    print(
        f"dpojax: starting from {os.path.join(workdir, CONFIG_FILE)}, the run's saved config "
        "(--config.<key>=<value> changes a key)",
        file=sys.stderr,
    )
    return [argv[0], f"--config={recipe}:{workdir}", *argv[1:]]
