"""One-line errors for what absl's flag parser reports badly: an unknown override (the whole key
and the closest one), an error of the recipe's own code (its file and line), a recipe that
returns no ConfigDict (`dpojax.main`)."""

from __future__ import annotations

import importlib.machinery
import os
import re
import traceback
import types

import ml_collections

from dpojax.cli.argv import flag_value
from dpojax.errors import one_line


def override_hint(argv: list[str], text: str) -> str | None:
    """For an unknown `--config.a.b=...` override: the line naming the whole key and the
    suggestion, in the words of the config checks."""
    names = re.findall(r"'([^']+)'", text) + re.findall(r'"([^"]+)"', text)
    if not names:
        return None
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and match.group(1).split(".")[-1] == names[0]:
            key = match.group(1)
            hint = ""
            if len(names) > 1 and names[1] != names[0]:
                hint = f"; did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}"
                hint += f"{names[1]}'?"
            return f"config key '{key}' is unknown{hint}"
    return None


def unknown_key_line(argv: list[str], text: str) -> str | None:
    """For an override of a key the config tree does not have at all (`--config.eps=...`,
    `--config.mesh.context=...`: reported by the flag parser as just the missing name): the line
    naming the whole key and the closest key, or where every key is listed."""
    from dpojax import schema
    from dpojax.config.tree import all_keys

    name = text.strip().strip("'\"")
    for arg in argv:
        match = re.match(r"--config\.([\w.]+)", arg)
        if match and name in match.group(1).split("."):
            key = match.group(1)
            close = schema.closest_key(key, [k.name for k in all_keys()])
            hint = (
                f"; did you mean '{close}'?"
                if close
                else ": every key with its default is in docs/config.md (`python -m dpojax.config`)"
            )
            return f"config key '{key}' is unknown{hint}"
    return None


def recipe_line(argv: list[str], error: BaseException, text: str) -> str | None:
    """For an error raised by the recipe file's own code (its `get_config`): the file and line
    that raised it, the error and, for a missing config key, what to check."""
    given = flag_value(argv, "config")
    if given is None:
        return None
    recipe = given[2].split(":", 1)[0]  # a recipe may take an argument: FILE:ARG
    lines = [
        f.lineno
        for f in traceback.extract_tb(error.__traceback__)
        if os.path.realpath(f.filename) == os.path.realpath(recipe)
    ]
    if not lines:
        return None
    line = f"{recipe}:{lines[-1]}: the recipe raised {type(error).__name__}: {text}"
    if isinstance(error, AttributeError | KeyError):
        line += (
            " (a config key or section the config does not have: `python -m dpojax.config` "
            "lists every key; a workflow's collect.<name>.* keys exist once it is registered)"
        )
    return line


def not_a_config_line(recipe: str, result: object) -> str:
    """The line for a recipe whose get_config() returned `result`, which is no ConfigDict."""
    got = "None (is its return statement missing?)" if result is None else type(result).__name__
    return (
        f"{recipe}: get_config() returned {got}; a recipe must return an "
        "ml_collections.ConfigDict: start from dpojax.config.default_config(), change it and "
        "return it (configs/tiny_test.py)"
    )


def recipe_result_line(argv: list[str]) -> str | None:
    """For a --config recipe (FILE or FILE:ARG, a .py file) that defines no get_config() or
    whose get_config() returns no ConfigDict: the line naming the file and what a recipe must
    return. None where the recipe is fine, or raises (`recipe_line` names that)."""
    given = flag_value(argv, "config")
    if given is None:
        return None
    recipe, colon, arg = given[2].partition(":")
    if not recipe.endswith(".py") or not os.path.isfile(recipe):
        return None
    try:
        loader = importlib.machinery.SourceFileLoader("_dpojax_recipe_check", recipe)
        module = types.ModuleType(loader.name)
        loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            return (
                f"{recipe} defines no get_config(): a recipe is a Python file whose "
                "get_config() returns an ml_collections.ConfigDict (start from "
                "dpojax.config.default_config(); configs/tiny_test.py)"
            )
        result = module.get_config(arg) if colon else module.get_config()
    except Exception:  # noqa: BLE001 - an error of the recipe's own code: recipe_line's case
        return None
    if isinstance(result, ml_collections.ConfigDict):
        return None
    return not_a_config_line(recipe, result)


def flags_line(argv: list[str], error: Exception) -> str:
    """The one line for an error of absl's flag parsing: a recipe that returned no config, a
    malformed override, an unknown key, a recipe that failed to load, else the error itself."""
    text = one_line(error)
    return (
        recipe_result_line(argv)
        or override_hint(argv, text)
        or unknown_key_line(argv, text)
        or recipe_line(argv, error, text)
        or f"bad command line or config: {text}"
    )
