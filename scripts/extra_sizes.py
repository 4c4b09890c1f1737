"""What each of dpojax's extras adds to the base install, measured in the installed environment.

    python scripts/extra_sizes.py gpu-plan tpu-plan

For each extra: the distributions that `dpojax[extra]` requires, directly or through their own
requirements (with the extras they are asked for), less those the base install requires, and the
bytes of the files each one's RECORD lists. Only installed distributions count: install the extra
first. docs/plan.md quotes its output.
"""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements(requires: list[str], extras: set[str]) -> list[tuple[str, set[str]]]:
    """The (name, extras) of `requires` (a distribution's Requires-Dist lines) that apply on this
    platform with `extras` asked for."""
    out = []
    for line in requires:
        req = Requirement(line)
        asked = sorted(extras) or [""]
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in asked):
            continue
        out.append((canonicalize_name(req.name), set(req.extras)))
    return out


def closure(name: str, extras: set[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions `name[extras]` requires, itself included, by canonical name."""
    found: dict[str, tuple[metadata.Distribution, set[str]]] = {}
    todo = [(canonicalize_name(name), set(extras))]
    while todo:
        key, wanted = todo.pop()
        if key in found and wanted <= found[key][1]:
            continue
        try:
            dist = found[key][0] if key in found else metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue
        asked = (found[key][1] if key in found else set()) | wanted
        found[key] = (dist, asked)
        todo.extend(requirements(dist.requires or [], asked))
    return {key: dist for key, (dist, _) in found.items()}


def installed_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        path = Path(dist.locate_file(f))
        if path.is_file():
            total += path.stat().st_size
    return total


def added_by(extra: str, package: str = "dpojax") -> list[tuple[str, int]]:
    """(name, bytes) of each distribution `package[extra]` adds to `package`, largest first."""
    base = closure(package, set())
    added = {k: d for k, d in closure(package, {extra}).items() if k not in base}
    return sorted(((k, installed_bytes(d)) for k, d in added.items()), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="+")
    for extra in parser.parse_args(argv).extras:
        sizes = added_by(extra)
        total = sum(b for _, b in sizes)
        parts = ", ".join(f"{name} {b / 1e6:,.0f} MB" for name, b in sizes)
        print(f"{extra}: {total / 1e9:.2f} GB ({total / 2**30:.2f} GiB) in {len(sizes)}: {parts}")


if __name__ == "__main__":
    main()
