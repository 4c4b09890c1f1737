"""The repository's promises to newcomers: README commands and CI stay in sync."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_ci_runs_the_slow_tier_once():
    """CI's time: the README's command (the whole suite) is the only pytest run without a marker
    expression; every other leg leaves the slow tier out (`not slow`, plus the tests marked
    `newest` on the newest JAX stack)."""
    ci = (ROOT / ".ci" / "run").read_text()
    subsets = re.findall(r'^\w+_SUBSET=\(-m "([^"]+)"\)$', ci, re.M)
    legs = re.findall(r"^newest_leg [\d.]+ \"\$\{(\w+)\[@\]\}\"$", ci, re.M)
    assert subsets and all(s.startswith("not slow") for s in subsets), subsets
    assert len(legs) == 2 and all(leg.endswith("_SUBSET") for leg in legs), legs
    assert (
        sum(
            line.strip().startswith("pip install -e") and "pytest" in line
            for line in ci.splitlines()
        )
        == 1
    )
    # its 2 workers come from the test extra (a pytest without xdist refuses `-n`)
    (addopts,) = re.findall(r'^export PYTEST_ADDOPTS="([^"]*)"$', ci, re.M)
    if "-n" in addopts.split():
        assert '"pytest-xdist' in (ROOT / "pyproject.toml").read_text()


def test_readme_workflow_example_runs(tmp_path, monkeypatch):
    """The README's user-workflow example is real code: load it by import path and collect."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# my_package/arith.py\n.*?)```", text, re.S).group(1)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "arith.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from dpojax.collect.runner import run_collection
    from dpojax.collect.workflow import load_workflow

    workflow = load_workflow("my_package.arith:Arithmetic", {"candidates": 3})

    def generate(prompts, k):
        return [["4", "9", "2"][:k] for _ in prompts]

    events, runs = run_collection(
        workflow, generate, num_runs=1, round_index=0, seed=0, continue_on_collection_error=False
    )
    assert len(events) == 9 and sum(e.score for e in events) == 3.0
    assert workflow.evaluate(lambda qs: ["4", "9", "2"]) == {"accuracy": 1.0}


def test_readme_torch_lines_name_the_cpu_wheel_index_for_cpu_only_machines():
    """The public index's Linux torch wheels are CUDA builds: README's CPU-only install line takes
    torch from PyTorch's CPU wheel index, and says so in words."""
    text = " ".join((ROOT / "README.md").read_text().split())
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
    assert f"`pip install torch==2.13.0 {cpu_index}`" in text
    assert "PyTorch's CPU wheel index" in text
    for line in re.findall(r"`(pip install[^`]*torch==[^`]*)`", text):
        near = text[max(0, text.index(line) - 120) : text.index(line)]
        assert cpu_index in line or "CUDA" in near, line


@pytest.mark.slow  # imports TRL (and torch): seconds
def test_the_trl_mapping_names_only_settings_trl_takes():
    """docs/trl.md's DPOConfig table: every TRL name in its first column is a field of the
    installed TRL's DPOConfig (before: `warmup_ratio`, which TRL 1.16 with transformers 5
    refuses)."""
    import dataclasses

    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    text = (ROOT / "docs" / "trl.md").read_text()
    table = text.split("## DPOConfig and TrainingArguments", 1)[1].split("\n## ", 1)[0]
    names = [
        name
        for row in table.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([A-Za-z_]\w*)", row.split("|")[1])
    ]
    assert len(names) > 20, names
    assert [n for n in names if n not in fields] == []
