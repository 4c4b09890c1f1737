"""The shipped recipes, by name: the repository's `configs/*.py`, installed as the package
`dpojax.recipes` (pyproject.toml maps that package to `configs/`, so the wheel and an editable
install carry the same files a clone runs as `--config configs/<recipe>.py`).

`source("train_pairs")` is the shipped `train_pairs.py` where no file of that name is in the
current directory; a path that exists always wins. The recipes are loaded by path, so a recipe
reads its own files relative to itself (`Path(__file__).parent / "models" / ...`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dpojax.errors import ConfigProblem

PACKAGE = "dpojax.recipes"


def recipe_dir() -> Path | None:
    """The folder of the shipped recipes: the installed `dpojax.recipes`, or, for a source tree
    imported without installing it (its root on sys.path), its `configs/`. None when neither is
    there."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    tree = Path(__file__).resolve().parents[2] / "configs"
    return tree if (tree / "__init__.py").is_file() else None


def names() -> list[str]:
    """The shipped recipes' names, sorted (`train_pairs` for `train_pairs.py`)."""
    folder = recipe_dir()
    if folder is None:
        return []
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


def _is_name(text: str) -> bool:
    """A bare recipe name (`train_pairs`, `train_pairs.py`): no folder, no other suffix."""
    return os.sep not in text and "/" not in text and Path(text).suffix in ("", ".py")


def unknown_line(text: str) -> str:
    """The error line for `text`: no such file, and no shipped recipe's name."""
    shipped = ", ".join(names()) or "none found"
    return f"{text}: no such file or shipped recipe (shipped, by name: {shipped})"


def source(text: str | os.PathLike) -> Path:
    """`text` as a path when it exists or names no recipe (a missing `.json` / `.yaml` is left
    to the saved-config reader); else the shipped recipe it names. Raises ConfigProblem, listing
    the shipped names, for a bare name or a `.py` file that is neither."""
    path = Path(text)
    name = os.fspath(text)
    if path.exists() or not (_is_name(name) or path.suffix == ".py"):
        return path
    folder = recipe_dir()
    shipped = folder / f"{path.stem}.py" if folder is not None else None
    if _is_name(name) and shipped is not None and shipped.is_file() and shipped.stem[0] != "_":
        return shipped
    raise ConfigProblem(unknown_line(name))
