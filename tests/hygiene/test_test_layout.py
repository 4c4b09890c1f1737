"""The test suite's own layout: every test module in the folder of its kind (which gives it its
marker), shared code in tests/helpers, and the fast loop's marker expression in the README."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import KINDS

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
HELPERS = TESTS / "helpers"


def _python_files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_test_modules_live_in_a_kind_folder():
    """tests/<kind>/...: unit (tests/unit/<package area>/), e2e, multiprocess, hygiene."""
    wrong = [
        str(path.relative_to(ROOT))
        for path in _python_files()
        if path.name.startswith("test_") and path.relative_to(TESTS).parts[0] not in KINDS
    ]
    assert not wrong, f"move these into tests/{{{','.join(KINDS)}}}/: {wrong}"


def test_shared_code_lives_in_helpers():
    """A module that is neither a test module, a conftest nor a package marker is shared code:
    it belongs in tests/helpers/ (and helpers hold no tests)."""
    plain = {"__init__.py", "conftest.py"}
    wrong = [
        str(path.relative_to(ROOT))
        for path in _python_files()
        if (HELPERS in path.parents) == (path.name.startswith("test_") or path.name in plain)
        and not (path.parent == HELPERS and path.name == "__init__.py")
    ]
    assert not wrong, f"helpers belong in tests/helpers/, tests outside it: {wrong}"


def test_readme_fast_loop_leaves_out_slow_tests():
    """The README's fast command deselects the `slow` marker (tests/conftest.py gives it to every
    e2e and multiprocess test)."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"python -m pytest[^`\n]*-m \"([^\"]+)\"", readme)
    assert commands, 'README.md shows no fast test command (python -m pytest ... -m "...")'
    assert all(expression == "not slow" for expression in commands), commands
