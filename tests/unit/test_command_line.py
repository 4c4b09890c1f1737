"""The command line's own surface, in process: its log lines, --help, -v, and an unknown key."""

from __future__ import annotations

import io
import logging
import re

import pytest
from absl import logging as absl_logging

from dpojax import main, runtime, schema
from dpojax.cli import error_lines
from dpojax.config.tree import all_keys


@pytest.fixture
def root_logging():
    """The root logger's handlers and level, and the filters of the loggers the CLI touches,
    put back after the test."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    touched = ["transformers", "absl", *runtime.NOISY_LOGGERS]
    filters = {name: list(logging.getLogger(name).filters) for name in touched}
    levels = {name: logging.getLogger(name).level for name in touched}
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name in touched:
        logging.getLogger(name).filters[:] = filters[name]
        logging.getLogger(name).setLevel(levels[name])


LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|DEBUG) ")


def test_log_lines_are_time_level_message(root_logging):
    """Before: absl's handler gave `I1127 22:01:25.493506 140462985988992 autofit.py:120] ...`
    (thread id, source file) to every dpojax line."""
    out = io.StringIO()
    runtime.configure_cli_logging(False, stream=out)
    logging.getLogger("dpojax.jobs.train.autofit").info("auto-fit: the recipe fits")
    absl_logging.warning("a library's warning")
    logging.getLogger("dpojax.jobs.train").debug("not shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert all(LINE.match(line) for line in lines), lines
    assert lines[0].endswith(" INFO auto-fit: the recipe fits")
    assert lines[1].endswith(" WARNING a library's warning")


def test_verbose_logs_debug_with_the_logger_name(root_logging):
    out = io.StringIO()
    runtime.configure_cli_logging(True, stream=out)
    logging.getLogger("dpojax.jobs.train").debug("batch shapes")
    assert LINE.match(out.getvalue())
    assert out.getvalue().rstrip().endswith(" DEBUG dpojax.jobs.train: batch shapes")


def test_the_misleading_library_notices_are_dropped_and_only_they(root_logging, monkeypatch):
    """transformers' "PyTorch was not found" (dpojax's models are JAX's) and orbax's warning at
    every save between evaluations, where there is no metric to track by design."""
    out = io.StringIO()
    runtime.configure_cli_logging(False, stream=out)
    runtime.quiet_library_notices()  # twice: one filter per logger
    transformers_log = logging.getLogger("transformers")
    # once transformers is imported its logger keeps its records to its own handler; here they
    # reach the root's handler whether an earlier test in this process imported it or not
    monkeypatch.setattr(transformers_log, "propagate", True)
    transformers_log.warning(
        "PyTorch was not found. Models won't be available and only tokenizers, configuration "
        "and file/data utilities can be used."
    )
    transformers_log.warning("a tokenizer warning")
    absl_logging.warning("Requested `tracked_metric`; did not provide metrics.")
    absl_logging.warning("a checkpoint warning")
    text = out.getvalue()
    assert "PyTorch" not in text and "tracked_metric" not in text
    assert "a tokenizer warning" in text and "a checkpoint warning" in text
    assert len(transformers_log.filters) == 1


@pytest.fixture
def cli_env(monkeypatch):
    monkeypatch.setenv("DPOJAX_HUGEPAGE_MALLOC", "0")  # no restart of the test process
    monkeypatch.setenv("DPOJAX_XLA_CPU_FLAGS", "0")


@pytest.mark.parametrize("argv0", ["/opt/venv/bin/dpojax", "/work/main/dpojax/main.py"])
def test_help_exits_0_under_the_program_name(cli_env, monkeypatch, capsys, argv0):
    """Before: absl's --help exited 1 (README: 1 is an unexpected error) and headed the options
    with the module's absolute path."""
    monkeypatch.setattr("sys.argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as exit_:
        main.cli()
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    program = "dpojax" if argv0.endswith("/dpojax") else "python -m dpojax.main"
    assert text.splitlines()[2].startswith(f"  {program} --config configs/<recipe>.py")
    assert "--workdir: Run directory" in text and "-v: the same as --verbose" in text
    assert "/work/main" not in text and "/opt/venv" not in text


def test_short_v_is_verbose(cli_env, monkeypatch):
    """absl's own -v is its C++ log verbosity (`-v --workdir x` failed: "invalid literal for
    int()")."""
    seen = {}
    monkeypatch.setattr("sys.argv", ["dpojax", "-v", "--workdir", "x"])
    monkeypatch.setattr(main.app, "run", lambda _main, argv, flags_parser: seen.update(argv=argv))
    main.cli()
    assert seen["argv"] == ["dpojax", "--verbose", "--workdir", "x"]


@pytest.mark.parametrize(
    ("verbose", "verbosity", "debug"), [(False, 0, False), (True, 0, True), (False, 1, True)]
)
def test_absls_verbosity_flag_still_turns_on_debug_logs(monkeypatch, verbose, verbosity, debug):
    """Before: with the command line's own handler, `--verbosity=1` (absl's flag, which gave
    DEBUG records under absl's handler) printed no DEBUG line."""
    monkeypatch.setattr(main.FLAGS["verbose"], "value", verbose)
    monkeypatch.setattr(main.FLAGS["verbosity"], "value", verbosity)
    assert main._wants_debug_logs() is debug


def test_an_unknown_key_with_no_near_match_is_named_with_where_keys_are_listed():
    """Before: `bad command line or config: context` for --config.mesh.context=4 (a key since
    issue 47; mesh.pipes stands in for it)."""
    argv = ["dpojax", "--config=configs/tiny_test.py", "--config.mesh.pipes=4"]
    assert error_lines.unknown_key_line(argv, "'pipes'") == (
        "config key 'mesh.pipes' is unknown: every key with its default is in docs/config.md "
        "(`python -m dpojax.config`)"
    )


def test_a_near_match_needs_a_close_last_part_too():
    keys = [k.name for k in all_keys()]
    assert schema.closest_key("mesh.pipes", keys) is None  # not 'mesh.tensor'
    assert schema.closest_key("lora.rnak", keys) == "lora.rank"
    assert schema.closest_key("optm.eps", keys) == "optim.eps"
    assert schema.closest_key("eps", keys) == "optim.eps"
