"""Fault injection for the command line: a signal at a random point of every mode, a full disk,
an unwritable workdir, a file in its place, a changed recipe on re-run. Each run ends with one
clear line and the documented exit code (README.md#exit-codes), and a re-run finishes with the
result of an uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dpojax.cli.error_lines import override_hint
from dpojax.errors import EXIT_CONFIG, EXIT_DATA, EXIT_IO, io_error
from dpojax.errors import one_line as _one_line
from dpojax.models.safetensors_io import load_tensors
from tests.e2e.test_cli import RECIPE, ROOT, _cli, _data, assets  # noqa: F401 - the fixture
from tests.helpers.customizer import start_server  # noqa: F401 - the fixture

RNG = random.Random(os.environ.get("DPOJAX_FAULT_SEED") or None)
LONG_TRAIN = ["--config.train.steps=300", "--config.train.eval_every=0"]
LONG_TRAIN += ["--config.checkpoint.every_steps=100", "--config.train.report_plots=False"]
# Every run here shares one compilation cache (a run-control key: re-runs may change it) and
# skips the huge-page restart, so that each costs its start-up and little more.
CACHE = Path(os.environ.get("DPOJAX_TEST_CACHE", "/tmp/dpojax-test-fault-cache"))
FAST = [f"--config.compilation_cache_dir={CACHE}", "--config.compilation_cache_min_seconds=0"]
ENV = {"DPOJAX_HUGEPAGE_MALLOC": "0"}


class Run:
    """A background CLI run whose stderr lines are collected as they come."""

    def __init__(self, workdir, *overrides, env_extra=None, config=RECIPE):
        cmd = [sys.executable, "-m", "dpojax.main", f"--config={config}", f"--workdir={workdir}"]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", **ENV, **(env_extra or {}))
        self.proc = subprocess.Popen(
            [*cmd, *overrides, *FAST],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, timeout: float = 300) -> bool:
        """Waits until `predicate()` holds (True) or the run ended (False)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, "\n".join(self.lines[-20:])
            time.sleep(0.02)
        return True

    def seen(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def interrupt(self, sig, jitter=(0.0, 0.5)) -> None:
        time.sleep(RNG.uniform(*jitter))
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def storm(self, sig, every: float = 0.05) -> None:
        """Sends `sig` again and again until the run ends (a late one must not kill it)."""
        while self.proc.poll() is None:
            self.proc.send_signal(sig)
            time.sleep(every)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.reader.join(10)
            raise AssertionError(
                f"the run did not end within {timeout} s; its last lines:\n"
                + "\n".join(self.lines[-30:])
            ) from None
        self.reader.join(10)
        return code, self.lines[-1] if self.lines else ""


def _same_export(a: Path, b: Path) -> None:
    x, y = load_tensors(a / "model.safetensors"), load_tensors(b / "model.safetensors")
    assert x.keys() == y.keys()
    for name in x:
        np.testing.assert_array_equal(x[name], y[name], err_msg=name)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):  # noqa: F811
    """An uninterrupted 300-step run."""
    work = tmp_path_factory.mktemp("reference") / "run"
    _run(work, *_data(assets), *LONG_TRAIN)
    return work


def _run(workdir, *overrides, config=RECIPE, check=True) -> Run:
    """A CLI run to its end (asserting exit 0 when `check`)."""
    run = Run(workdir, *overrides, config=config)
    code, _ = run.finish()
    if check:
        assert code == 0, "\n".join(run.lines[-30:])
    run.code = code
    return run


# ----------------------------------------------------------------- messages


def test_one_line_messages_keep_quotes_balanced_and_the_key():
    raw = AttributeError("'\\'stepz\\'\\nDid you mean \"steps\" instead of \"stepz\"?'")
    text = _one_line(raw)
    assert text == '\'stepz\' Did you mean "steps" instead of "stepz"?'
    assert text.count("'") % 2 == 0 and text.count('"') % 2 == 0
    argv = ["prog", "--config=x.py", "--config.train.stepz=3"]
    assert override_hint(argv, text) == (
        "config key 'train.stepz' is unknown; did you mean 'train.steps'?"
    )
    assert _one_line(KeyError("a 'quoted' key")) == "a 'quoted' key"


def test_io_errors_are_found_behind_library_errors():
    inner = OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as outer:
        assert io_error(outer) is inner
    text = ValueError(
        'RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/2/x": Failed to write '
        "21595 bytes: No space left on device [os_error_code='28']"
    )
    found = io_error(text)
    assert found.errno == errno.ENOSPC and found.filename == "/w/checkpoints/2/x"
    assert io_error(ValueError("bad data")) is None


def test_unknown_override_names_the_whole_key(tmp_path):
    proc = _cli(tmp_path / "w", "--config.train.stepz=3", check=False)
    assert proc.returncode == EXIT_CONFIG
    assert proc.stderr.strip().splitlines()[-1] == (
        "dpojax: error: config key 'train.stepz' is unknown; did you mean 'train.steps'?"
    )
    # A key given without its group. Before: "bad command line or config: eps", no hint.
    proc = _cli(tmp_path / "w", "--config.eps=1e-6", check=False)
    assert proc.returncode == EXIT_CONFIG
    assert proc.stderr.strip().splitlines()[-1] == (
        "dpojax: error: config key 'eps' is unknown; did you mean 'optim.eps'?"
    )


def test_an_error_in_the_recipe_names_its_file_and_line(tmp_path):
    """Before: "bad command line or config: nosuch", nothing about where."""
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text(
        "from dpojax.config import default_config\n\n\n"
        "def get_config():\n"
        "    config = default_config()\n"
        "    config.collect.nosuch.games = 5\n"
        "    return config\n"
    )
    cmd = [sys.executable, "-m", "dpojax.main", f"--config={recipe}", f"--workdir={tmp_path}/w"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == EXIT_CONFIG
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dpojax: error: {recipe}:6: the recipe raised AttributeError: ")
    assert "nosuch" in last and "python -m dpojax.config" in last
    assert not (tmp_path / "w").exists()


# ----------------------------------------------------------------- the workdir and the disk


def _unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot write in: no permission, or (as root, whom permissions
    do not stop) a read-only mount."""
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        (parent / "probe").write_text("x")
    except PermissionError:
        return parent
    (parent / "probe").unlink()
    parent.chmod(0o700)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(parent)]
    ).returncode:
        pytest.skip("cannot make an unwritable directory here")
    return parent


@pytest.mark.parametrize("kind", ["file in its place", "unwritable"])
def test_workdir_problems_are_one_line_with_the_io_exit_code(assets, tmp_path, kind):  # noqa: F811
    if kind == "file in its place":
        work = tmp_path / "run"
        work.write_text("not a directory")
        fix = "a file is in the way"
    else:
        work = _unwritable(tmp_path) / "run"
        fix = "choose another --workdir"
    try:
        proc = _cli(work, *_data(assets), check=False)
    finally:
        subprocess.run(["umount", str(work.parent)], capture_output=True)
    assert proc.returncode == EXIT_IO, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dpojax: error: cannot write {work}") and fix in last
    assert "Traceback" not in proc.stderr


def test_a_workdir_name_too_long_is_one_line_with_the_io_exit_code(assets, tmp_path):  # noqa: F811
    """Before: a 300-character workdir name exited 3 with the file system's text."""
    work = tmp_path / ("w" * 300)
    proc = _cli(work, *_data(assets), check=False)
    assert proc.returncode == EXIT_IO, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("dpojax: error: cannot write ") and "shorter --workdir" in last


def _small_disk(tmp_path: Path) -> Path | None:
    """A 24 MB tmpfs (None where mounting is not allowed: the mocked writer covers the path)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)]).returncode:
        return None
    return disk


def _fill(disk: Path) -> Path:
    """Fills `disk` up. It may be full already: on a loaded machine the run's own checkpoint
    writes can get there first (the old ones are deleted in the background)."""
    filler = disk / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    return filler


def _checkpoints(work: Path) -> set[int]:
    directory = work / "checkpoints"
    if not directory.is_dir():
        return set()
    # committed steps only: a step being written is a `STEP.orbax-checkpoint-tmp` folder
    return {
        int(p.name)
        for p in directory.iterdir()
        if p.name.isdigit() and (p / "commit_success.txt").is_file()
    }


def test_train_signals_and_a_full_disk_then_the_rerun_matches(assets, reference, tmp_path):  # noqa: F811
    disk = _small_disk(tmp_path)
    work = (disk or tmp_path) / "run"
    args = [*_data(assets), *LONG_TRAIN]
    try:
        # 1. Early: while the job sets up (model, data, compilation) or takes its first steps.
        run = Run(work, *args)
        run.wait_for(work.is_dir)
        run.interrupt(signal.SIGINT, jitter=(0.0, 1.5))
        code, last = run.finish()
        assert code == 0 and "stopped by SIGINT" in last, "\n".join(run.lines[-10:])
        # 2. Mid-run, after some steps: a checkpoint, a summary, the line saying how to go on.
        metrics = work / "metrics.jsonl"

        def steps() -> int:
            return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

        target = min(steps() + 20, 250)
        run = Run(work, *args)
        run.wait_for(lambda: steps() >= target)
        run.interrupt(signal.SIGTERM, jitter=(0.0, 0.1))
        code, last = run.finish()
        assert code == 0 and "stopped by SIGTERM" in last, "\n".join(run.lines[-10:])
        assert "rerun the same command" in last
        assert json.loads((work / "summary.json").read_text())["status"] == "stopped by SIGTERM"
        # 3. The disk fills up after the next checkpoint: one line, the I/O exit code.
        if disk is not None:
            kept = _checkpoints(work)
            run = Run(work, *args)
            assert run.wait_for(lambda: _checkpoints(work) - kept), "\n".join(run.lines[-20:])
            filler = _fill(disk)
            code, last = run.finish()
            assert code == EXIT_IO, "\n".join(run.lines[-20:])
            assert last.startswith(f"dpojax: error: cannot write {work}"), last
            assert "No space left on device" in last and "free space" in last
            assert not any(line.startswith("Traceback") for line in run.lines)
            filler.unlink(missing_ok=True)
        # 4. The re-run resumes from the last complete checkpoint and ends as the
        # uninterrupted run did, with one metric line a step.
        _run(work, *args)
        _same_export(work / "export", reference / "export")
        logged = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in logged if x["split"] == "train"] == list(range(1, 301))
    finally:
        if disk is not None:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _cli_script(script: str, work, model_and_data) -> subprocess.CompletedProcess:
    """The command line run by `script` (which patches dpojax, then calls `cli()`) on the test
    data, in `work`."""
    cmd = [sys.executable, "-c", script, f"--config={RECIPE}", f"--workdir={work}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", **ENV)
    return subprocess.run(
        [*cmd, *_data(model_and_data), *FAST], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_a_failing_writer_is_one_line_with_the_io_exit_code(assets, tmp_path):  # noqa: F811
    """A full disk without a small disk to fill: every metrics write fails with ENOSPC."""
    script = (
        "import errno, sys\n"
        "from dpojax.train import metrics_io\n"
        "def full(self, *a, **k):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
        "metrics_io.TensorBoardSink._event_file = full\n"
        "from dpojax.main import cli\n"
        "sys.argv[0] = 'dpojax'\n"
        "cli()\n"
    )
    work = tmp_path / "run"
    proc = _cli_script(script, work, assets)
    assert proc.returncode == EXIT_IO, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"dpojax: error: cannot write {work}")


# A SIGINT delivered from inside the run at a chosen point, where the command's raising handler
# is in force: before the train job takes the signals over, and in the job's tail after it hands
# them back (summary.json), in plain code and inside a finalizer (where Python prints an exception
# as a traceback and drops it; the garbage collector runs finalizers at any allocation).
SIGNAL_AT = """\
import signal, sys
import dpojax.jobs, dpojax.jobs.train

class SignalOnDelete:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)

original = getattr({module}, {name!r})

def signal_first(*args, **kwargs):
    if {finalizer}:
        SignalOnDelete()  # finalized at once: the handler runs inside __del__
    else:
        signal.raise_signal(signal.SIGINT)
    return original(*args, **kwargs)

setattr({module}, {name!r}, signal_first)
from dpojax.main import cli
sys.argv[0] = "dpojax"
cli()
"""


@pytest.mark.parametrize(
    "module, name, finalizer",
    [
        ("dpojax.jobs", "run_job", True),
        ("dpojax.jobs.train", "atomic_write_text", False),
        ("dpojax.jobs.train", "atomic_write_text", True),
    ],
    ids=["before-the-job-in-a-finalizer", "in-the-tail", "in-the-tail-in-a-finalizer"],
)
def test_a_signal_around_the_train_job_ends_cleanly(assets, tmp_path, module, name, finalizer):  # noqa: F811
    """Before the job: the run stops with the stop line. In the job's tail (every step taken,
    every file but summary.json written): the run completes as if no signal came. Never a
    traceback, always exit 0."""
    script = SIGNAL_AT.format(module=module, name=name, finalizer=finalizer)
    work = tmp_path / "run"
    proc = _cli_script(script, work, assets)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any("Traceback" in x or "Exception ignored" in x for x in lines), proc.stderr
    if name == "run_job":
        assert lines[-1].startswith("dpojax: stopped by SIGINT"), proc.stderr[-3000:]
    else:
        assert not any("stopped by" in x for x in lines), proc.stderr[-3000:]
        assert any("completed at step 6 of 6" in x for x in lines), proc.stderr[-3000:]
        assert json.loads((work / "summary.json").read_text())["status"] == "completed"


WRAPPED_SIGNAL = """\
import sys
import dpojax.jobs
from dpojax.interrupts import Interrupted

def wrapped(*args, **kwargs):
    try:
        raise Interrupted("SIGTERM")  # what the handler raises when the signal comes
    except Interrupted as e:  # as CPython reports it from inside a call from C code
        raise SystemError("<function f> returned a result with an exception set") from e

dpojax.jobs.run_job = wrapped
from dpojax.main import cli
sys.argv[0] = "dpojax"
cli()
"""


def test_a_signal_that_surfaces_wrapped_is_the_stop(assets, tmp_path):  # noqa: F811
    """A signal whose handler raised inside a call from C code reaches the command as a
    SystemError caused by the interruption (seen once in CI: SIGTERM during a plan compile gave
    exit 1 and "dpojax: SystemError: <function _ScalarMeta.__numpy_dtype__ ...> returned a result
    with an exception set"); it is the stop: its line, exit 0, no traceback."""
    proc = _cli_script(WRAPPED_SIGNAL, tmp_path, assets)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[-1].startswith("dpojax: stopped by SIGTERM before the job"), proc.stderr[-3000:]
    assert not any("Traceback" in x or "SystemError" in x for x in lines), proc.stderr[-3000:]


# ----------------------------------------------------------------- signals in the other modes


def test_evaluate_and_export_signals(assets, reference, tmp_path):  # noqa: F811
    work = tmp_path / "run"
    shutil.copytree(reference, work)
    shutil.rmtree(work / "export")
    # (export reads no pairs: it is ready once its model is built)
    for mode, ready in (("evaluate", "pairs tokenized"), ("export", "attention: ")):
        run = Run(work, *_data(assets), f"--config.mode={mode}")
        run.wait_for(lambda run=run, ready=ready: run.seen(ready))
        if mode == "evaluate":
            run.interrupt(signal.SIGTERM, jitter=(0.0, 0.4))
        else:  # signals until it has exited: the stop, then late ones during its exit
            time.sleep(RNG.uniform(0.0, 0.4))
            run.storm(signal.SIGTERM)
        code, last = run.finish()
        assert code == 0, "\n".join(run.lines[-10:])
        assert "stopped by SIGTERM" in last or not run.seen("stopped by"), last
        assert not [p for p in work.iterdir() if ".tmp-" in p.name]  # no partial output left
        _run(work, *_data(assets), f"--config.mode={mode}")
    metrics = json.loads((work / "evaluate" / "metrics.json").read_text())
    assert len((work / "evaluate" / "pairs.jsonl").read_text().splitlines()) == 8
    assert np.isfinite(metrics["loss"])
    _same_export(work / "export", reference / "export")


LOOP = [
    "--config.mode=loop",
    "--config.collect.workflow=tests.helpers.plugin_workflow:CountingWorkflow",
    "--config.collect.max_new_tokens=3",
    "--config.collect.min_score_diff=0.5",
    "--config.loop.rounds=1",
    "--config.loop.best_metric=mean_length",
    "--config.train.steps=0",
    "--config.train.epochs=2",
    "--config.data.max_length=32",
    "--config.train.report_plots=False",
]


def test_collect_and_loop_signals_then_reruns_match_and_a_changed_recipe_is_refused(
    assets,  # noqa: F811
    tmp_path,
):
    _, model = assets
    args = [*LOOP, f"--config.model.path={model}"]
    full = tmp_path / "full"
    _run(full, *args)
    # (tests/unit/jobs/test_loop_resume.py compares an interrupted collection's re-run with an
    # uninterrupted one, and interrupts each phase of a loop in turn.)
    for mode, wait_for in (("collect", "initial"), ("loop", "round 1 of 1")):
        work = tmp_path / mode
        run = Run(work, *args, f"--config.mode={mode}")
        if mode == "collect":
            run.wait_for(work.is_dir)
            run.interrupt(signal.SIGTERM, jitter=(0.0, 1.0))
        else:
            run.wait_for(lambda run=run, text=wait_for: run.seen(text))
            run.interrupt(signal.SIGTERM, jitter=(0.0, 3.0))  # collection, training or eval
        code, last = run.finish()
        assert code == 0, "\n".join(run.lines[-10:])
        assert "stopped by SIGTERM" in last or not run.seen("stopped by"), last
        _run(work, *args, f"--config.mode={mode}")
    assert json.loads((tmp_path / "collect" / "summary.json").read_text())["status"] == "completed"
    loop = tmp_path / "loop"
    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, loop))
    # the rounds' records less their timings and the greedy-answer comparison (made only when the
    # previous round was evaluated by the same run)
    drop = ("seconds", "model", "elapsed_seconds", "phase_seconds", "phase_cpu_seconds")
    drop += ("cpu_seconds", "greedy_answers")
    strip = lambda s: [{k: v for k, v in r.items() if k not in drop} for r in s]  # noqa: E731
    assert strip(a["rounds"]) == strip(b["rounds"]) and b["status"] == "completed"
    _same_export(full / "export", loop / "export")
    # A changed recipe: refused before anything is written, naming the key and the fix.
    before = {p: p.stat().st_mtime_ns for p in loop.rglob("*")}
    run = _run(loop, *args, "--config.optim.learning_rate=0.5", check=False)
    assert run.code == EXIT_CONFIG
    last = run.lines[-1]
    assert "optim.learning_rate" in last and "another --workdir" in last
    assert {p: p.stat().st_mtime_ns for p in loop.rglob("*")} == before


def test_submit_signal_cancels_the_job_then_a_rerun_completes(start_server, tmp_path):  # noqa: F811
    from dpojax.customizer_server.backends import SimulateBackend
    from dpojax.data.pair_files import write_pairs
    from tests.helpers.customizer import make_pairs

    server = start_server(SimulateBackend(seconds_per_epoch=2.0))
    pairs = tmp_path / "pairs.jsonl"
    write_pairs(make_pairs(6), pairs, format="customizer")
    args = [
        f"--config.data.train_path={pairs}",
        f"--config.customizer.entity_host={server.url}",
        f"--config.customizer.datastore_host={server.url}",
        "--config.customizer.poll_interval_seconds=0.05",
    ]
    config = ROOT / "configs" / "customizer.py"
    run = Run(tmp_path / "run", *args, config=config)
    run.wait_for(lambda: run.seen("Waiting for training job"))
    run.interrupt(signal.SIGTERM, jitter=(0.0, 1.0))
    code, last = run.finish()
    assert code == 130, "\n".join(run.lines[-10:])
    assert last.startswith("dpojax: error: interrupted (SIGTERM)") and "cancel" in last
    (job,) = server.store.jobs.values()
    assert server.app.state.backend.status(job)["status"] == "cancelled"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpojax.main",
            f"--config={config}",
            f"--workdir={tmp_path / 'run'}",
            *args,
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------- one run per workdir, its inputs


def _last(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_poison_values_and_a_raising_chat_template_end_with_one_line(assets, tmp_path):  # noqa: F811
    """Before: vocab_chunk=-5 exited 1 with a reshape TypeError; learning_rate=nan with
    nonfinite=skip "completed" with an all-NaN export; a raising chat template exited 1 with
    `TemplateError: boom`, naming no key, file or record."""
    proc = _cli(tmp_path / "a", *_data(assets), "--config.train.vocab_chunk=-5", check=False)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    assert _last(proc) == "dpojax: error: config key 'train.vocab_chunk' must be >= 0, got -5"
    nan = ["--config.optim.learning_rate=nan", "--config.train.nonfinite=skip"]
    proc = _cli(tmp_path / "b", *_data(assets), *nan, check=False)
    assert proc.returncode == EXIT_CONFIG and "'optim.learning_rate' must be a finite" in _last(
        proc
    )

    chat = tmp_path / "chat.jsonl"
    turn = {"prompt": [{"role": "user", "content": "hi"}]}
    turn["chosen"] = [{"role": "assistant", "content": "yes"}]
    turn["rejected"] = [{"role": "assistant", "content": "no"}]
    chat.write_text(json.dumps(turn) + "\n")
    template = "--config.data.chat_template={{ raise_exception('boom') }}"
    data = [*_data(assets)[:1], f"--config.data.train_path={chat}", template]
    proc = _cli(tmp_path / "c", *data, "--config.train.batch_size=1", check=False)
    assert proc.returncode == EXIT_DATA, proc.stderr[-2000:]
    assert _last(proc).startswith(f"dpojax: error: {chat}: pair 0: the chat template failed")
    assert "boom" in _last(proc) and "Traceback" not in proc.stderr


def test_a_second_run_on_a_busy_workdir_and_a_workdir_deleted_mid_run(assets, tmp_path):  # noqa: F811
    """Before: two runs on one workdir both started (and failed inside the checkpoint library,
    metrics.jsonl holding duplicated rows); a workdir deleted mid-run exited 3 with the storage
    library's text."""
    work = tmp_path / "run"
    endless = ["--config.train.steps=1000000", "--config.train.eval_every=0"]
    # a save every 5 steps: the run finds its workdir gone within 5 steps of the deletion
    endless += ["--config.checkpoint.every_steps=5", "--config.train.report_plots=False"]
    first = Run(work, *_data(assets), *endless)
    try:
        _busy_then_deleted(assets, work, first, endless)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()


def _busy_then_deleted(assets, work, first, endless):  # noqa: F811
    metrics = work / "metrics.jsonl"
    assert first.wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 3)
    second = _cli(work, *_data(assets), *endless, *FAST, check=False)
    assert second.returncode == EXIT_CONFIG, second.stderr[-2000:]
    assert f"{work} is in use by another run (pid {first.proc.pid} on host" in _last(second)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[0] == 1  # nothing duplicated or truncated
    while work.exists():  # the run writes on meanwhile
        shutil.rmtree(work, ignore_errors=True)
    code, last = first.finish()
    assert code == EXIT_IO, "\n".join(first.lines[-20:])
    assert last.startswith(f"dpojax: error: cannot write {work}: the workdir was deleted")


def test_a_rerun_of_a_finished_run_and_a_replaced_model(assets, reference, tmp_path):  # noqa: F811
    """Before: each rerun of a finished run appended another final evaluation row; a resume on a
    model folder whose weights were replaced went on with another frozen reference."""
    from dpojax.models.tiny import make_tiny_checkpoint

    work = tmp_path / "run"
    shutil.copytree(reference, work)

    def evals():
        lines = (work / "metrics.jsonl").read_text().splitlines()
        return [line for line in lines if '"split": "eval"' in line]

    before = evals()
    _run(work, *_data(assets), *LONG_TRAIN)
    assert evals() == before

    model = tmp_path / "model"
    shutil.copytree(_data(assets)[0].split("=", 1)[1], model)
    short = [f"--config.model.path={model}", *_data(assets)[1:], "--config.train.steps=2"]
    short += ["--config.train.report_plots=False"]
    _run(tmp_path / "short", *short)
    make_tiny_checkpoint(tmp_path / "other", "llama", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", model / "model.safetensors")
    run = _run(tmp_path / "short", *short, check=False)
    assert run.code == EXIT_DATA, "\n".join(run.lines[-10:])
    assert f"model.path: the files in {model} are not those the run" in run.lines[-1]
    assert "allow_input_change" in run.lines[-1]


def test_a_signal_during_the_plan_compile_stops_cleanly(assets, tmp_path):  # noqa: F811
    """Before (up to 5ed9f1d): SIGTERM while plan or evaluate compiled printed the stop line, then
    the interpreter's teardown raced XLA's compile threads: a segfault (exit 139) in 1 of 4 tries
    here, 5 of 5 in the report. Since then the process ends with os._exit after the line."""
    for attempt in range(3):
        run = Run(tmp_path / f"plan{attempt}", *_data(assets)[:1], "--config.mode=plan")
        run.wait_for(lambda run=run: run.seen("compiling recipe"))
        run.interrupt(signal.SIGTERM, jitter=(0.0, 1.5))
        code, last = run.finish()
        assert code == 0, "\n".join(run.lines[-10:])
        assert "stopped by SIGTERM" in last or not run.seen("stopped by"), last
