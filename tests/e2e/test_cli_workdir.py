"""End to end: one run, one config. A finished LoRA run is evaluated and exported from its
workdir alone (its config.json; export reads no data); its saved config passed back as --config
(here as YAML) gives the same evaluation; a recipe that does not fit the checkpoint names the
setting the run used; the progress is a plain line in a log; every mode ends with a line naming
its outputs; --help names every mode and the key reference."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from dpojax.config.modes import MODES
from tests.e2e.test_cli import ROOT, _cli, assets  # noqa: F401 - assets: the fixture


def _bare(*args):
    """`python -m dpojax.main` with exactly `args` (no recipe)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, "-m", "dpojax.main", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)


def _last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_help_names_every_mode_and_the_key_reference():
    proc = _bare("--help")
    text = proc.stdout + proc.stderr
    for mode in MODES:
        assert f"\n  {mode} " in text, mode
    assert "docs/config.md" in text and "python -m dpojax.config" in text
    assert "--config.mode=evaluate" in text and "config.json" in text


def test_lora_run_evaluated_and_exported_from_its_workdir_alone(assets, tmp_path):  # noqa: F811
    base, model = assets
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        shutil.copy(base / name, data / name)
    work = tmp_path / "run"
    train = _cli(
        work,
        f"--config.model.path={model}",
        f"--config.data.train_path={data / 'train.jsonl'}",
        f"--config.data.eval_path={data / 'eval.jsonl'}",
        "--config.lora.rank=4",
        "--config.train.steps=2",
        "--config.train.eval_every=0",
        "--config.train.progress=True",  # stderr is a pipe: plain lines, not a bar
        "--config.export.enabled=False",
    )
    assert "train: step 1 of 2 (50%), loss 0.6931" in train.stderr
    assert "train: step 2 of 2 (100%)" in train.stderr
    assert _last_line(train).startswith("dpojax: train completed at step 2 of 2; wrote ")
    assert not (work / "export").exists()
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steps_this_run"] == 2 and summary["runtime_seconds"] > 0
    assert summary["pairs_per_second"] == pytest.approx(8 / summary["runtime_seconds"], rel=1e-2)

    evaluate = _bare(f"--workdir={work}", "--config.mode=evaluate")
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    assert f"starting from {work / 'config.json'}" in evaluate.stderr
    assert _last_line(evaluate).endswith(
        f"wrote {work / 'evaluate' / 'metrics.json'}, {work / 'evaluate' / 'pairs.jsonl'}"
    )
    metrics = json.loads((work / "evaluate" / "metrics.json").read_text())

    saved = tmp_path / "run.yaml"  # the saved config, passed back as --config
    saved.write_text(yaml.safe_dump(json.loads((work / "config.json").read_text())))
    again = _bare(f"--config={saved}", f"--workdir={work}", "--config.mode=evaluate")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((work / "evaluate" / "metrics.json").read_text()) == metrics

    shutil.rmtree(data)  # export reads no data
    export = _bare("--workdir", str(work), "--config.mode=export")
    assert export.returncode == 0, export.stderr[-3000:]
    assert _last_line(export) == f"dpojax: export done; wrote {work / 'export'}"
    assert (work / "export" / "config.json").is_file()
    assert (work / "export" / "adapter" / "adapter_config.json").is_file()

    recipe = _cli(work, f"--config.model.path={model}", "--config.mode=export", check=False)
    assert recipe.returncode == 3, recipe.stderr[-3000:]
    assert "this run used lora.rank=4 (this command: 0)" in recipe.stderr


def test_without_config_or_a_run_the_error_says_what_is_needed(tmp_path):
    proc = _bare(f"--workdir={tmp_path / 'empty'}")
    assert proc.returncode == 2
    assert "--config is required unless --workdir holds a run" in proc.stderr


@pytest.mark.parametrize("content", ["{broken", '{"lora": {"rnak": 4}}'])
def test_a_bad_saved_config_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content)
    proc = _bare(f"--config={path}", f"--workdir={tmp_path / 'w'}")
    assert proc.returncode == 2
    assert str(path) in proc.stderr and "Traceback" not in proc.stderr
