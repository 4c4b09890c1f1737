"""Prints pyproject.toml's requirements, one per line: the project's dependencies and those of the
extras named on the command line. .ci/run installs them into the newer Pythons' venvs in the
background while the 3.11 leg tests, so that each leg's own `pip install -e ".[test]"` only builds
dpojax itself.

    python .ci/requirements.py test
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"{PYPROJECT}: no extra {extra!r} in [project.optional-dependencies]")
        found += project["optional-dependencies"][extra]
    return found


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
