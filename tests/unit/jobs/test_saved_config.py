"""A run's saved config comes back as a config: from its workdir (with the changes a resumed run
recorded), from a JSON or YAML file, on the command line without --config or as --config; bad
files are refused naming the file and the key; a checkpoint that does not fit names the setting
the run used."""

from __future__ import annotations

import json

import pytest
import yaml

from dpojax.cli import argv as argv_rewrite
from dpojax.config import default_config, frozen
from dpojax.errors import ConfigErrors, ConfigProblem
from dpojax.jobs import outputs_line
from dpojax.jobs.workdir import (
    CHANGES_FILE,
    CONFIG_FILE,
    check_config,
    config_record,
    saved_config,
    saved_recipe,
    used_settings,
)


def _run_config():
    config = default_config()
    config.model.path = "/models/tiny"
    config.lora.rank = 16
    config.lora.targets = ("q_proj", "v_proj")
    config.optim.learning_rate = 2  # an int where a float is expected comes back a float
    config.customizer.hf_token = "hf_secret"
    return config


def test_a_workdir_gives_back_the_config_it_was_run_with(tmp_path):
    config = _run_config()
    check_config(frozen(config), tmp_path, resuming=False)
    assert "hf_secret" not in (tmp_path / CONFIG_FILE).read_text()
    back = saved_config(tmp_path)
    assert back.to_dict() == {**config.to_dict(), "customizer": back.customizer.to_dict()}
    assert back.lora.rank == 16 and back.lora.targets == ("q_proj", "v_proj")
    assert isinstance(back.optim.learning_rate, float)
    assert back.customizer.hf_token == ""  # redacted: the default (the environment's token)


def test_recorded_changes_are_applied(tmp_path):
    check_config(frozen(_run_config()), tmp_path, resuming=False)
    changed = _run_config()
    changed.allow_config_change = True
    changed.train.steps = 99
    check_config(frozen(changed), tmp_path, resuming=True)
    assert (tmp_path / CHANGES_FILE).is_file()
    assert saved_config(tmp_path).train.steps == 99


def test_json_and_yaml_files(tmp_path):
    record = config_record(frozen(_run_config()))
    (tmp_path / "run.json").write_text(json.dumps(record))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(record))
    for name in ("run.json", "run.yaml"):
        assert saved_config(tmp_path / name).lora.rank == 16


def test_bad_files_name_the_file_and_the_key(tmp_path):
    record = config_record(frozen(_run_config()))
    record["lora"]["rnak"] = 4
    record["train"]["steps"] = "ten"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigErrors) as info:
        saved_config(path)
    assert (
        f"{path}: config key 'lora.rnak' is unknown; did you mean 'lora.rank'?" in info.value.errors
    )
    assert any(f"{path}: config key 'train.steps' must be int" in e for e in info.value.errors)
    path.write_text("{not json")
    with pytest.raises(ConfigProblem, match="run.json: not a saved config"):
        saved_config(path)
    with pytest.raises(ConfigProblem, match="holds no config.json"):
        saved_config(tmp_path)
    with pytest.raises(ConfigProblem, match="no such saved config or workdir"):
        saved_config(tmp_path / "missing.json")


def test_a_mismatch_names_the_setting_the_run_used(tmp_path):
    check_config(frozen(_run_config()), tmp_path, resuming=False)
    other = _run_config()
    assert used_settings(frozen(other), tmp_path) is None
    other.lora.rank = 0
    other.data.eval_path = "elsewhere.jsonl"  # data does not shape a checkpoint
    hint = used_settings(frozen(other), tmp_path)
    assert hint.startswith("this run used lora.rank=16 (this command: 0); leave out --config")
    assert "data.eval_path" not in hint
    assert used_settings(frozen(other), tmp_path / "nothing") is None


def test_command_line_starts_from_the_workdir_or_a_saved_file(tmp_path, capsys):
    recipe = saved_recipe.__file__
    work = str(tmp_path / "run")
    argv = ["dpojax", f"--workdir={work}", "--config.mode=export"]
    assert argv_rewrite.with_saved_config(argv) == argv  # no run there yet
    (tmp_path / "run").mkdir()
    check_config(frozen(_run_config()), tmp_path / "run", resuming=False)
    assert argv_rewrite.with_saved_config(argv) == [
        "dpojax",
        f"--config={recipe}:{work}",
        *argv[1:],
    ]
    assert "starting from" in capsys.readouterr().err
    spaced = ["dpojax", "--workdir", work]
    assert argv_rewrite.with_saved_config(spaced)[1] == f"--config={recipe}:{work}"
    saved = f"{work}/config.json"
    for given in ([f"--config={saved}"], ["--config", saved]):
        assert argv_rewrite.with_saved_config(["dpojax", *given, "--workdir=x"]) == [
            "dpojax",
            f"--config={recipe}:{saved}",
            "--workdir=x",
        ]
    recipe_argv = ["dpojax", "--config=configs/tiny_test.py", f"--workdir={work}"]
    assert argv_rewrite.with_saved_config(recipe_argv) == recipe_argv  # a recipe is kept


def test_the_last_line_names_what_exists(tmp_path):
    (tmp_path / "export").mkdir()
    assert outputs_line("export", tmp_path / "export", tmp_path) == (
        f"export done; wrote {tmp_path / 'export'}"
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    line = outputs_line("train", {"status": "completed", "step": 6, "total_steps": 6}, tmp_path)
    assert line == (
        f"train completed at step 6 of 6; wrote {tmp_path / 'checkpoints'}, "
        f"{tmp_path / 'summary.json'}, {tmp_path / 'export'}"
    )
    metrics = {"loss": 0.5, "rewards/accuracies": 0.75}
    assert outputs_line("evaluate", metrics, tmp_path / "none").startswith(
        "evaluate done (loss 0.5000, accuracy 0.750); wrote nothing in"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nosuch://bucket/run", r"no storage library handles nosuch://"),
        ("gcs+x://b/r", r"no storage library handles gcs\+x://"),
        ("gs://", "name a bucket and a folder"),
    ],
)
def test_object_store_workdirs_that_cannot_work_are_refused_before_anything_runs(url, message):
    from dpojax.jobs import run

    with pytest.raises(ConfigProblem, match=message):
        run(default_config(), url)


def test_the_report_lists_only_the_settings_that_differ_from_the_defaults():
    from dpojax.jobs.workdir import settings_text

    assert settings_text(frozen(default_config())) == "# every setting is its default"
    lines = settings_text(frozen(_run_config())).splitlines()
    assert lines[0].startswith("# the settings that differ from the defaults")
    assert lines[1:] == [
        'model.path = "/models/tiny"',
        "lora.rank = 16",
        'lora.targets = ["q_proj", "v_proj"]',
        "optim.learning_rate = 2.0",
        'customizer.hf_token = "<redacted>"',
    ]
