"""The mode records: every mode's job exists, its stop line fills from a stopped job's result, and
a run's last line names the outputs its record lists."""

import pytest

from dpojax.config.modes import MODE_RECORDS, MODES
from dpojax.jobs import outputs_line, stop_summary


def test_one_record_per_mode_of_the_config():
    from dpojax.config import default_config, frozen

    assert tuple(MODE_RECORDS) == MODES and frozen(default_config()).mode in MODES
    assert all(m.name == name and m.outputs and m.summary for name, m in MODE_RECORDS.items())


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_says_how_to_go_on_after_a_signal(mode, tmp_path):
    assert stop_summary(mode, {"status": "completed"}, tmp_path) is None
    line = stop_summary(mode, {"status": "stopped by SIGTERM"}, tmp_path)
    assert line.startswith("stopped by SIGTERM") and "rerun the same command" in line


def test_the_stop_lines_of_train_and_loop_name_what_is_kept(tmp_path):
    stopped = {"status": "stopped by SIGINT", "step": 4, "total_steps": 9}
    assert stop_summary("train", stopped, tmp_path) == (
        f"stopped by SIGINT at step 4 of 9; the checkpoint of step 4 is in "
        f"{tmp_path / 'checkpoints'}; rerun the same command to resume"
    )
    first = stop_summary("train", {"status": "stopped by SIGINT"}, tmp_path)
    assert "at step 0 of ?; no step was taken;" in first
    loop = stop_summary("loop", {"status": "stopped by SIGTERM", "rounds_done": 2}, tmp_path)
    assert loop.startswith("stopped by SIGTERM after 2 finished round(s); they are kept in")
    plan = stop_summary("plan", {"status": "stopped by SIGTERM"}, tmp_path)
    assert plan == "stopped by SIGTERM: plan wrote nothing partial; rerun the same command"


def test_the_last_line_names_the_outputs_of_the_record(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "summary.json").write_text("{}")  # not a plan's output
    assert outputs_line("plan", {"status": "planned"}, tmp_path) == (
        f"plan planned; wrote {tmp_path / 'plan.json'}"
    )
