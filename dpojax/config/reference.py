"""docs/config.md, generated from the config tree: `python -m dpojax.config > docs/config.md`
(tests/hygiene/test_architecture.py checks that the page is current)."""

from __future__ import annotations

from dpojax import schema
from dpojax.config.modes import mode_table
from dpojax.config.ranges import RANGES
from dpojax.config.tree import all_keys


def reference_page() -> str:
    """docs/config.md: every key with its default, choices and meaning."""
    lines = [
        "# Config reference",
        "",
        "Every key of the config tree, generated from `dpojax/config/tree.py` by",
        "`python -m dpojax.config > docs/config.md` (a test checks that it is current). Recipes",
        "start from `default_config()`; override any key with `--config.<key>=<value>`. A number",
        "outside its range, and any non-finite number (`nan`, `inf`), is refused at start-up.",
        "",
    ]
    known = all_keys()
    sections: dict[str, list[schema.Key]] = {}
    for key in known:
        head = key.name.split(".")[0] if "." in key.name else ""
        if key.name.startswith("collect.") and key.name.count(".") > 1:
            head = ".".join(key.name.split(".")[:2])
        sections.setdefault(head, []).append(key)
    for head, members in sections.items():
        lines += [f"## {head or 'top level'}", ""]
        lines += schema.describe(members, {k: r.text() for k, r in RANGES.items()})
        lines.append("")
    lines += [
        "## Modes",
        "",
        "What `mode` chooses (`dpojax/config/modes.py`, one record a mode).",
        "",
    ]
    lines += [*mode_table(), ""]
    return "\n".join(lines)
