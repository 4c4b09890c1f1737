"""Prints the JAX stack a CI leg installed and checks it against pyproject.toml's bounds.

    python .ci/versions.py lowest   # each package is at its lower bound
    python .ci/versions.py newest   # each is the newest release its bounds allow on this Python

Exits 1 naming each package that is not where the leg expects it. On Python 3.11 pip resolves
the bounds to their lower ends (jax 0.11 and later need Python >= 3.12), so that leg tests the
oldest supported releases; a newer Python gets the newest ones. jaxlib must equal jax.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

STACK = ("jax", "flax", "optax", "orbax-checkpoint")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements() -> dict[str, Requirement]:
    """The dependencies of pyproject.toml that make up the stack."""
    found = {}
    for line in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name in STACK:
            found[requirement.name] = requirement
    return found


def lower_bound(requirement: Requirement) -> Version:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    if not bounds:
        raise SystemExit(f"{PYPROJECT}: {requirement} has no lower bound (>=)")
    return max(bounds)


def newest_allowed(requirement: Requirement) -> Version:
    """The newest release of the index that pip would install here within the bounds (pip's
    own listing: the releases with files for this Python)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", requirement.name],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in listing.splitlines() if x.startswith("Available versions:"))
    releases = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
    return max(v for v in releases if requirement.specifier.contains(v))


def main(mode: str) -> int:
    print(f"Python {platform.python_version()}: ", end="")
    installed = {name: Version(version(name)) for name in STACK}
    print(", ".join(f"{name} {v}" for name, v in installed.items()), end="")
    print(f", jaxlib {version('jaxlib')}")
    problems = []
    if Version(version("jaxlib")) != installed["jax"]:
        problems.append(f"jaxlib {version('jaxlib')} differs from jax {installed['jax']}")
    for name, requirement in requirements().items():
        want = lower_bound(requirement) if mode == "lowest" else newest_allowed(requirement)
        if installed[name] != want:
            problems.append(
                f"{name} is {installed[name]}, the {mode} allowed ({requirement}) is {want}"
            )
    for problem in problems:
        print(f"versions: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("lowest", "newest"):
        raise SystemExit("usage: python .ci/versions.py lowest|newest")
    sys.exit(main(sys.argv[1]))
