"""The repository's promises to newcomers: README commands and CI stay in sync."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S).group(1)
    return [line for line in first_block.splitlines() if line and not line.startswith("#")]


def test_readme_top_shows_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("pip install") and "python -m dpojax" in commands[0]
    assert commands[1].startswith("pip install") and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines
    assert any("torch==2.13.0" in line for line in ci_lines)
    assert "ruff check ." in ci_lines and "ruff format --check ." in ci_lines
