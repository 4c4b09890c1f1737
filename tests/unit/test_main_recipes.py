"""The command line and a broken recipe (issue 50, defect 9): a get_config() that returns a dict or
None, or is missing, is named with the file and what a recipe must return; a stop signal while
the recipe loads is the stop (its line, exit 0) instead of a silent 143."""

from __future__ import annotations

import signal

import pytest

from dpojax import main

FINE = (
    "from dpojax.config import default_config\n\ndef get_config():\n    return default_config()\n"
)
RECIPES = {
    "dict": "from dpojax.config import default_config\n\n"
    "def get_config():\n    return default_config().to_dict()\n",
    "none": "def get_config():\n    config = 1\n",
    "missing": "CONFIG = {}\n",
    "signal": "import signal\n\ndef get_config():\n"
    "    signal.raise_signal(signal.SIGTERM)\n    raise AssertionError('the load went on')\n",
}


@pytest.fixture
def parse(tmp_path, monkeypatch, capsys):
    """Parses a command line naming a recipe of RECIPES in-process: (exit code, stderr lines,
    the last line printed with `_print_last`)."""
    last = []
    monkeypatch.setattr(main, "_print_last", last.append)
    monkeypatch.setattr(main, "_exit", lambda code, at_once=False: exit(code))

    def run(kind: str, *overrides: str):
        recipe = tmp_path / f"{kind}.py"
        recipe.write_text(RECIPES.get(kind, FINE))
        argv = ["dpojax", f"--config={recipe}", f"--workdir={tmp_path}/w", *overrides]
        with pytest.raises(SystemExit) as info:
            main._parse_flags(argv)
            main._load_config()
            exit(-1)  # a recipe that loads: the test asked for one that does not
        return info.value.code, capsys.readouterr().err.strip().splitlines(), last, recipe

    yield run
    main.FLAGS.unparse_flags()


@pytest.mark.parametrize("overrides", [(), ("--config.model.path=/m",)], ids=["alone", "override"])
@pytest.mark.parametrize("kind", ["dict", "none"])
def test_get_config_must_return_a_config_dict(parse, kind, overrides):
    """Before: a dict gave "'model.path' is unknown; did you mean 'model.path'?" (or, without
    overrides, a bare AttributeError and exit 1); None gave "--config is required"."""
    code, lines, _, recipe = parse(kind, *overrides)
    got = "dict" if kind == "dict" else "None (is its return statement missing?)"
    assert code == 2
    assert lines[-1] == (
        f"dpojax: error: {recipe}: get_config() returned {got}; a recipe must return an "
        "ml_collections.ConfigDict: start from dpojax.config.default_config(), change it and "
        "return it (configs/tiny_test.py)"
    )


def test_a_recipe_without_get_config_is_named(parse):
    """Before: "bad command line or config: module 'config_config' has no attribute
    'get_config'"."""
    code, lines, _, recipe = parse("missing", "--config.model.path=/m")
    assert code == 2
    assert lines[-1].startswith(f"dpojax: error: {recipe} defines no get_config(): a recipe")
    assert "ml_collections.ConfigDict" in lines[-1]


def test_a_fine_recipe_has_no_such_line(tmp_path):
    recipe = tmp_path / "fine.py"
    recipe.write_text(FINE)
    assert main._recipe_result_line(["dpojax", f"--config={recipe}"]) is None


def test_a_signal_while_the_recipe_loads_is_the_stop(parse):
    """Before: SIGTERM during the recipe's load killed the process (exit 143, no line)."""
    previous = signal.getsignal(signal.SIGTERM)
    code, _, last, _ = parse("signal")
    assert code == 0
    assert last == [
        "dpojax: stopped by SIGTERM before the job had anything to save; rerun the same "
        "command to start it again"
    ]
    assert signal.getsignal(signal.SIGTERM) is previous
