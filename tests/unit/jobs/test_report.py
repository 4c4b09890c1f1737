"""write_report: report.md with a final-metrics table and valid PNG plots; robust to gaps."""

import math
import re
import struct

import pytest

from dpojax.jobs.train.report import final_metrics, write_report
from dpojax.train.metrics_io import MetricsWriter

ALL_PLOTS = (
    "loss",
    "accuracy",
    "margins",
    "rewards",
    "logps",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
)
EVAL_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def _train(step):
    return {
        "loss": 0.69 - 0.002 * step,
        "rewards/accuracies": min(1.0, 0.4 + 0.01 * step),
        "rewards/margins": 0.01 * step,
        "rewards/chosen": 0.004 * step,
        "rewards/rejected": -0.006 * step,
        "logps/chosen": -40.0 + 0.1 * step,
        "logps/rejected": -41.0 - 0.1 * step,
        "learning_rate": 1e-6 * min(1.0, step / 10),
        "grad_norm": 2.0 / (1 + step),
        "tokens_per_s": 1000.0 + step,
    }


def _write_run(workdir, steps=30, eval_every=10):
    with MetricsWriter(workdir) as writer:
        for step in range(1, steps + 1):
            writer.write(step, _train(step))
            if step % eval_every == 0:
                metrics = {k: v + 0.05 for k, v in _train(step).items() if k in EVAL_KEYS}
                writer.write(step, metrics, split="eval")


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 5000, path
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert width >= 400 and height >= 200


def _table(report):
    """{metric: [cell, ...]} from the final-metrics table of report.md."""
    section = report.split("## Final metrics")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return {cells[0]: cells[1:-1] for cells in (r.strip("| ").split(" | ") for r in rows[1:])}


def test_report_with_all_metrics(tmp_path):
    _write_run(tmp_path)
    summary = {"final_step": 30, "best_eval_loss": 0.66, "model": "tiny|model"}
    path = write_report(
        tmp_path, title="Tiny run", summary=summary, config_text="loss.beta = 0.1\n"
    )
    assert path == tmp_path / "report.md"
    report = path.read_text()
    assert report.startswith("# Tiny run\n")
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert links == [f"plots/{name}.png" for name in ALL_PLOTS]
    for link in links:
        _assert_png(tmp_path / link)
    table = _table(report)
    assert "| metric | train (step 30) | eval (step 30) | meaning |" in report
    assert table["loss"] == ["0.63", "0.68"]
    assert table["rewards/accuracies"] == ["70.0%", "75.0%"]
    assert table["tokens_per_s"] == ["1,030 tokens/s", "-"]
    assert table["learning_rate"] == ["1e-06", "-"]
    assert list(table)[:3] == ["loss", "rewards/accuracies", "rewards/margins"]
    assert "| best_eval_loss | 0.66 |" in report and "| model | tiny\\|model |" in report
    assert "```text\nloss.beta = 0.1\n```" in report


@pytest.mark.slow
def test_missing_metrics_skip_plots(tmp_path):
    _write_run(tmp_path)
    write_report(tmp_path, title="first")
    workdir = tmp_path / "loss_only"
    with MetricsWriter(workdir) as writer:
        for step in range(5):
            writer.write(step, {"loss": 1.0 / (step + 1), "tokens_per_s": 10.0})
    # A stale plot from an earlier report of this workdir must not survive.
    (workdir / "plots").mkdir()
    (workdir / "plots" / "accuracy.png").write_bytes(b"old")
    report = write_report(workdir, title="Loss only").read_text()
    assert sorted(p.name for p in (workdir / "plots").iterdir()) == [
        "loss.png",
        "tokens_per_s.png",
    ]
    assert "plots/accuracy.png" not in report
    assert "eval (step" not in report
    assert "## Summary" not in report and "## Config" not in report


def test_single_step(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(0, _train(0))
        writer.write(0, {"loss": math.log(2)}, split="eval")
    report = write_report(tmp_path, title="one step").read_text()
    for name in ALL_PLOTS:
        _assert_png(tmp_path / "plots" / f"{name}.png")
    assert _table(report)["loss"] == ["0.69", "0.6931"]


def test_nan_and_inf_values(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in range(1, 4):
            writer.write(step, {"loss": math.nan, "rewards/margins": math.inf, "grad_norm": 1.0})
            writer.write(step, {"grad_norm": math.nan if step == 2 else 1.0 * step}, split="x")
        writer.write(3, {"loss": 0.5}, split="eval")
    report = write_report(tmp_path, title="nan").read_text()
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["grad_norm.png", "loss.png"]  # margins: no finite value at all
    _assert_png(tmp_path / "plots" / "loss.png")
    table = _table(report)
    assert "| metric | train (step 3) | eval (step 3) | x (step 3) | meaning |" in report
    assert table["loss"] == ["nan", "0.5", "-"]
    assert table["rewards/margins"] == ["inf", "-", "-"]


def test_no_metrics_and_disabled(tmp_path):
    report = write_report(tmp_path, title="empty", summary={"note": "nothing ran"})
    assert "No metrics were recorded." in report.read_text()
    assert not any((tmp_path / "plots").iterdir())
    other = tmp_path / "other"
    _write_run(other, steps=3)
    path = write_report(other, title="not process 0", enabled=False)
    assert path == other / "report.md" and not path.exists()
    assert not (other / "plots").exists()


def test_final_metrics_keep_last_value_of_each_metric():
    records = [
        {"step": 2, "split": "train", "time": 0.0, "loss": 0.5, "grad_norm": 3.0},
        {"step": 1, "split": "train", "time": 0.0, "loss": 0.9, "grad_norm": 9.0},
        {"step": 3, "split": "train", "time": 0.0, "loss": 0.4},
    ]
    assert final_metrics(records) == {"train": (3, {"loss": 0.4, "grad_norm": 3.0})}


@pytest.mark.parametrize("config_text", ["a = 1", "doc = '''```python\nx\n```'''"])
def test_config_fence_survives_backticks(tmp_path, config_text):
    report = write_report(tmp_path, title="t", config_text=config_text).read_text()
    body = report.split("## Config\n\n")[1]
    fence = body.split("text\n")[0]
    assert body == f"{fence}text\n{config_text}\n{fence}\n"
    assert fence.count("`") == (3 if "```" not in config_text else 4)


def test_report_without_plots(tmp_path):
    _write_run(tmp_path)
    report = write_report(tmp_path, title="No plots", plots=False).read_text()
    assert "## Plots" not in report and "![" not in report
    assert not (tmp_path / "plots").exists()
    assert _table(report)["loss"] == ["0.63", "0.68"]


def test_rounds_report_shows_the_decimals_that_tell_rounds_apart(tmp_path):
    """Before: every value had three decimals, so a tie-break of 0.00044 showed as 0.000."""
    from dpojax.jobs.train.report import write_rounds_report

    rounds = [
        {"round": 0, "illegal_move_rate": 0.0, "optimal_move_rate": 0.5},
        {
            "round": 1,
            "num_pairs": 10,
            "illegal_move_rate": 0.00044,
            "optimal_move_rate": 0.98,
            "train_loss": 0.41,
        },
        {
            "round": 2,
            "num_pairs": 12,
            "illegal_move_rate": 0.0,
            "optimal_move_rate": 0.98,
            "train_loss": 0.3525,
        },
    ]
    out = {
        "initial": rounds[0],
        "final": rounds[2],
        "best_round": 2,
        "rounds": rounds,
        "wall_seconds": 12.0,
    }
    metrics = ["illegal_move_rate", "optimal_move_rate"]
    text = write_rounds_report(tmp_path, out, metrics, metrics).read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    cells = {r: [c.strip() for c in rows[r].split("|")[1:-1]] for r in ("1", "2")}
    assert cells["1"][2] != cells["2"][2]  # illegal_move_rate: 0.00044 vs 0
    assert float(cells["1"][2]) == pytest.approx(0.00044, abs=5e-5)
    assert cells["1"][-1] == "0.4100" and cells["2"][-1] == "0.3525"  # train_loss shown
    assert "Gate" not in text and "Best round: 2; wall time 12 s.\n" in text
    out["gate"] = {"conditions": "a>=1", "first_met_round": 2, "first_met_seconds": 9.6}
    out["gate"]["met_rounds"] = [2]
    text = write_rounds_report(tmp_path, out, metrics, metrics).read_text()
    assert (
        "Best round: 2; wall time 12 s. Gate `a>=1`: first met at round 2, 10 s into the loop; "
        "met in rounds 2." in text
    )


def test_human_units():
    from dpojax.jobs.train.report import human_bytes, human_duration, summary_value

    assert [human_bytes(b) for b in (512, 3 * 2**19, 707452928, 1.5 * 2**30, 3 * 2**40)] == [
        "512 B",
        "1.5 MiB",
        "674.7 MiB",
        "1.50 GiB",
        "3.00 TiB",
    ]
    assert [human_duration(s) for s in (0.25, 12.34, 130, 3725)] == [
        "0.25 s",
        "12.3 s",
        "2m10s",
        "1h02m",
    ]
    assert summary_value("runtime_seconds", 22.576) == "22.6 s"
    assert summary_value("compile_seconds", 4000.0) == "1h06m"
    assert summary_value("peak_device_bytes", 80 * 2**30) == "80.00 GiB"
    assert summary_value("pairs_per_second", 1.063) == "1.06 pairs/s"
    assert summary_value("tokens_per_second", 123456.7) == "123,457 tokens/s"
    assert summary_value("steps_this_run", 6) == "6"  # not a unit it knows: as it is
    assert (
        summary_value("push_to_hub", {"repo": "me/m", "error": "a|b"}) == "repo=me/m, error=a\\|b"
    )


def _finals(tmp_path, extra):
    base = {
        "loss": 0.5,
        "preference_loss": 0.5,
        "acc": 0.75,
        "rewards/accuracies": 0.75,
        "rewards/chosen": 0.3,
        "rewards_chosen_mean": 3.0,
        "tokens": 1234.0,
        "nonfinite": 0.0,
    }
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {**base, **extra})
    return write_report(tmp_path, title="t", plots=False).read_text()


def test_each_metric_once_with_its_meaning(tmp_path):
    """acc / rewards_*_mean repeat other metrics under other tools' names: one row each."""
    report = _finals(tmp_path, {})
    table = _table(report)
    assert list(table) == ["loss", "rewards/accuracies", "rewards/chosen", "tokens", "nonfinite"]
    assert table["tokens"] == ["1,234"] and table["nonfinite"] == ["0"]
    assert "| loss | 0.5 | the optimized loss" in report
    note = report.split("Also in metrics.jsonl under other tools' names: ")[1].splitlines()[0]
    assert note.startswith("acc (rewards/accuracies); rewards_chosen_mean (rewards/chosen")
    assert "preference_loss (loss: no SFT term)" in note
    # With an SFT term the preference term differs from loss and gets its own row.
    table = _table(_finals(tmp_path / "sft", {"preference_loss": 0.4}))
    assert table["preference_loss"] == ["0.4"] and table["loss"] == ["0.5"]


def test_summary_in_human_units_without_the_final_metric_sets(tmp_path):
    summary = {
        "status": "completed",
        "final_train": {"loss": 0.5},
        "final_eval": None,
        "peak_host_rss_bytes": 707452928,
        "runtime_seconds": 3725.0,
        "pairs_per_second": 1.063,
    }
    report = write_report(tmp_path, title="t", summary=summary, plots=False).read_text()
    rows = report.split("## Summary")[1].split("## Final metrics")[0]
    assert "final_train" not in rows and "final_eval" not in rows
    assert "| peak_host_rss_bytes | 674.7 MiB |" in rows
    assert "| runtime_seconds | 1h02m |" in rows
    assert "| pairs_per_second | 1.06 pairs/s |" in rows


def _games_out():
    initial = {"round": 0, "optimal_move_rate": 0.0, "losses_vs_random": 400}
    initial["games_vs_random"] = 400
    final = {**initial, "round": 1, "optimal_move_rate": 0.957, "losses_vs_random": 0}
    final["num_pairs"], final["train_loss"] = 12, 0.35
    rounds = [initial, final]
    return {"initial": initial, "final": final, "best_round": 1, "rounds": rounds}


def test_the_loop_tables_show_game_counts_as_integers_with_what_they_count(tmp_path, capsys):
    """Before: `losses_vs_random  400.000  0.000`, a count under a name that reads like a loss,
    in the printed table and in report.md."""
    from dpojax.collect.workflow import metric_labels
    from dpojax.jobs.rounds import _print_table
    from dpojax.jobs.train.report import write_rounds_report
    from dpojax.workflows.tictactoe.workflow import TicTacToeWorkflow

    out = {**_games_out(), "wall_seconds": 12.0}
    labels = metric_labels(TicTacToeWorkflow, out["initial"])
    assert labels == {"losses_vs_random": "games lost of 400 against a random player"}
    metrics = ["optimal_move_rate", "losses_vs_random"]
    text = write_rounds_report(tmp_path, out, metrics, metrics, labels).read_text()
    assert "| losses_vs_random (games lost of 400 against a random player) | 400 | 0 |" in text
    assert "400.0" not in text
    assert "| 1 | 12 | 0.9570 | 0 | 0.3500 |" in text  # the per-round table: the count as is
    _print_table(out, metrics, labels)
    printed = capsys.readouterr().out.splitlines()
    row = next(line for line in printed if line.startswith("losses_vs_random"))
    assert row.split()[-2:] == ["400", "0"] and "games lost of 400" in row
    rate = next(line for line in printed if line.startswith("optimal_move_rate"))
    assert rate.split()[-2:] == ["0.000", "0.957"]


def test_metric_labels_without_the_attribute_or_the_field():
    from dpojax.collect.workflow import metric_labels

    assert metric_labels(object(), {"losses": 3}) == {}

    class Workflow:
        metric_labels = {"losses": "lost of {games}", "absent": "x"}

    assert metric_labels(Workflow, {"losses": 3}) == {"losses": "lost of {games}"}


def test_summary_records_are_rows_not_raw_json(tmp_path):
    """Before: auto-fit's record was one row of raw JSON in report.md."""
    auto_fit = {
        "changed": {},
        "needed_bytes": 13842712.0,
        "tried": {"the recipe": 13842712.0},
        "line": "auto-fit: the recipe fits (13.2 MiB per device; 16.42 GiB usable)",
    }
    summary = {
        "status": "completed",
        "auto_fit": auto_fit,
        "push": {"checked": {"token": "ok"}, "seconds": 3.5, "skipped": {}},
    }
    report = write_report(tmp_path, title="t", summary=summary, plots=False).read_text()
    assert "| auto_fit | auto-fit: the recipe fits (13.2 MiB per device; 16.42 GiB usable) |" in (
        report
    )
    assert "| push.checked | token=ok |" in report
    assert "| push.seconds | 3.5 s |" in report
    assert "| push.skipped | none |" in report
    assert "{" not in report.split("## Final metrics")[0]
