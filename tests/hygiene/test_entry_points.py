"""Every `dpojax.<module>[.<name>]` that README.md and docs/ name exists: a module or package
moved without updating the documents (or without an alias) fails here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAME = re.compile(r"\bdpojax(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
# Dotted names in the documents that are not Python objects: an entry-point group, a clone URL.
NOT_PYTHON = {"dpojax.workflows", "dpojax.git"}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_documented_names_import():
    names = {m for doc in DOCUMENTS for m in NAME.findall(doc.read_text())} - NOT_PYTHON
    missing = sorted(name for name in names if not _resolves(name))
    assert not missing, f"named in README.md / docs/ but not importable: {missing}"
