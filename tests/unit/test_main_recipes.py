"""The command line and a broken recipe (issue 50, defect 9): a get_config() that returns a dict or
None, or is missing, is named with the file and what a recipe must return; a stop signal while
the recipe loads is the stop (its line, exit 0) instead of a silent 143. The shipped recipes by
name (issue 51): `--config train_pairs` and `api.config("train_pairs")`, here and from an
installed wheel outside the clone; a file of that name in the current directory wins."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpojax import api, main
from dpojax.cli import argv as argv_rewrite
from dpojax.cli import error_lines
from dpojax.config import recipes
from dpojax.errors import ConfigProblem

ROOT = Path(__file__).resolve().parents[2]

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
    the last line printed with `output.print_last`)."""
    last = []
    monkeypatch.setattr(main.output, "print_last", last.append)
    monkeypatch.setattr(main.output, "exit_process", lambda code, at_once=False: exit(code))

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
    assert error_lines.recipe_result_line(["dpojax", f"--config={recipe}"]) is None


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


def test_shipped_recipes_by_name(tmp_path, monkeypatch):
    """A bare name is the shipped recipe (with or without .py) where no such file is in the
    current directory; a file of that name wins; any other name lists the shipped ones."""
    monkeypatch.chdir(tmp_path)
    shipped = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")
    assert recipes.names() == shipped
    assert recipes.source("train_pairs").samefile(ROOT / "configs" / "train_pairs.py")
    assert recipes.source("tiny_test.py").samefile(ROOT / "configs" / "tiny_test.py")
    assert api.config("train_pairs").train.batch_size == 32
    plan = Path(api.config("llama1b_tpu").plan.model_config)
    assert (plan / "config.json").is_file()  # read relative to the recipe file
    (tmp_path / "train_pairs.py").write_text(FINE)
    assert recipes.source("train_pairs.py") == Path("train_pairs.py")
    assert api.config("train_pairs.py").train.batch_size != 32  # the file here: the defaults
    for name in ("nope", "configs/nope.py"):
        with pytest.raises(ConfigProblem) as info:
            api.config(name)
        assert str(info.value) == (
            f"{name}: no such file or shipped recipe (shipped, by name: {', '.join(shipped)})"
        )
    assert recipes.source("runs/x.json") == Path("runs/x.json")  # the saved-config reader's


def test_command_line_names_a_shipped_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = argv_rewrite.with_recipe_name(["dpojax", "--config", "train_pairs:x", "--workdir=w"])
    assert argv == [
        "dpojax",
        f"--config={recipes.recipe_dir() / 'train_pairs.py'}:x",
        "--workdir=w",
    ]
    given = ["dpojax", f"--config={ROOT / 'configs' / 'tiny_test.py'}", "--config=gs://b/run"]
    assert argv_rewrite.with_recipe_name(given) == given  # a path, a bucket: left as they are
    with pytest.raises(SystemExit) as info:
        argv_rewrite.with_recipe_name(["dpojax", "--config=nope"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "dpojax: error: nope: no such file or shipped recipe (shipped, by name: customizer, "
    )


CHECK = """
import importlib, json, sys
import dpojax, dpojax.api as a
from pathlib import Path
try:
    a.config("nope")
except Exception as e:
    unknown = str(e)
config, plan = a.config("train_pairs"), a.config("llama1b_tpu")
print(json.dumps({
    "dpojax": dpojax.__file__,
    "recipes": importlib.import_module("dpojax.recipes").__file__,
    "batch_size": config.train.batch_size,
    "plan_model": str(Path(plan.plan.model_config) / "config.json"),
    "unknown": unknown,
}))
"""


def _install(kind: str, tmp_path: Path) -> Path:
    """A fresh venv (on the system site-packages: jax and the rest) with dpojax from a copy of
    this tree, as a wheel or an editable install: its python."""
    source = tmp_path / "source"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("dpojax", "configs"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True
    )
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    if kind == "editable":
        subprocess.run([*pip, "-e", source], check=True)
        return python
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", tmp_path / "dist", source],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    subprocess.run([*pip, "--force-reinstall", wheel], check=True)
    return python


@pytest.mark.slow  # builds and installs dpojax, then runs it twice in fresh processes: ~20 s each
@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_recipes_by_name_from_an_installed_dpojax_outside_the_clone(kind, tmp_path):
    """issue 51's "must show": the recipes ship with the package (dpojax.recipes is configs/),
    so a venv's python in a folder outside the clone finds them by name, with the model configs
    they read, through the API and the command line."""
    started = time.monotonic()
    python = _install(kind, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = dict(cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    done = subprocess.run([python, "-P", "-c", CHECK], **run)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    home = tmp_path / ("venv" if kind == "wheel" else "source")
    assert Path(got["dpojax"]).is_relative_to(home), got  # not the clone's dpojax
    recipes_dir = "venv/lib" if kind == "wheel" else "source/configs"
    assert Path(got["recipes"]).is_relative_to(tmp_path / recipes_dir), got
    assert got["batch_size"] == 32 and Path(got["plan_model"]).is_file(), got
    assert "shipped, by name: customizer, " in got["unknown"] and "train_pairs" in got["unknown"]
    command = [python, "-P", "-m", "dpojax.main", "--config", "train_pairs", "--workdir=w"]
    done = subprocess.run([*command, "--config.mode=nomode"], **run)
    assert done.returncode == 2  # the recipe loaded: the error is the override's
    assert "config key 'mode' must be one of" in done.stderr.strip().splitlines()[-1], done.stderr
    print(f"{kind}: {time.monotonic() - started:.1f} s")
