"""The repository's own Python files that are not in a package (scripts/, configs/), loaded by
path as a module for a test."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_file(relative: str, name: str | None = None) -> ModuleType:
    """The module of REPO_ROOT/`relative` (e.g. "scripts/loop_phases.py"), executed afresh."""
    path = REPO_ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
