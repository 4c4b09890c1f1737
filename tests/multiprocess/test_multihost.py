"""Multi-process runs on one machine, as on a TPU slice or a GPU cluster: `python -m dpojax.main`
in 2 or 4 processes (scripts/launch_local.py: 127.0.0.1 coordinator, CPU collectives, several
CPU devices per process) with one mesh over all their devices, compared with one process holding
the same global mesh. Also: a killed process stops the others with a message, a restart resumes
exactly, `mode=loop` collects its runs over the processes, a process that cannot join gives up
with a message."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dpojax.config import frozen
from dpojax.data.pair_files import write_pairs
from dpojax.data.pairs import PreferencePair
from dpojax.models.safetensors_io import load_tensors
from dpojax.models.tiny import make_tiny_checkpoint
from dpojax.train.metrics_io import read_metrics

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny_test.py")
LAUNCHER = str(ROOT / "scripts" / "launch_local.py")
# Per-step values that legitimately differ between runs.
UNTIMED = ("time", "tokens_per_s", "step", "split")
PAIRS_READ = re.compile(r"step (\d+): data partition (\d+) reads pairs \[([\d, ]*)\]")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    base = tmp_path_factory.mktemp("multihost")
    model = make_tiny_checkpoint(base / "model", "llama", seed=0)
    rng = np.random.default_rng(0)
    words = ["good", "bad", "move", "board", "win", "draw", "play", "next"]

    def pair(i):
        return PreferencePair(
            prompt=" ".join(rng.choice(words, size=int(rng.integers(2, 9)))) + f" {i}?",
            chosen=" yes " + " ".join(rng.choice(words, size=int(rng.integers(1, 4)))),
            rejected=" no " + words[(i + 3) % 8],
            metadata={},
        )

    write_pairs([pair(i) for i in range(24)], base / "train.jsonl", format="trl")
    write_pairs([pair(100 + i) for i in range(8)], base / "eval.jsonl", format="trl")
    return [
        f"--config={RECIPE}",
        f"--config.model.path={model}",
        f"--config.data.train_path={base / 'train.jsonl'}",
        f"--config.data.eval_path={base / 'eval.jsonl'}",
    ]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _launch(workdir, processes, devices, *args, background=False, grace=60):
    cmd = [
        sys.executable,
        LAUNCHER,
        f"--processes={processes}",
        f"--devices-per-process={devices}",
        f"--grace={grace}",
        "--quiet",
        "--",
        *args,
        f"--workdir={workdir}",
    ]
    if background:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(1), stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _single(workdir, devices, *args):
    """The same run in one process holding all `devices` (its log is returned)."""
    cmd = [sys.executable, "-m", "dpojax.main", *args, f"--workdir={workdir}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(devices), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _records(workdir, split="train") -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(workdir) if r["split"] == split}


def _max_diff(a: dict[int, dict], b: dict[int, dict]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[s][k] - b[s][k]) for s in a for k in a[s] if k not in UNTIMED and k in b[s])


def _max_weight_diff(a: Path, b: Path) -> float:
    x, y = load_tensors(a), load_tensors(b)
    assert sorted(x) == sorted(y)
    return max(float(np.abs(x[k] - y[k]).max()) for k in x)


def _pairs_read(log: str) -> dict[int, list[int]]:
    return {
        int(m[1]): [int(i) for i in m[3].split(",") if i.strip()] for m in PAIRS_READ.finditer(log)
    }


def _kill_process(workdir, process_id) -> None:
    """SIGKILL to the dpojax process `process_id` of the run in `workdir`."""
    wanted = {f"--workdir={workdir}", f"--config.distributed.process_id={process_id}"}
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")
        except OSError:
            continue
        if "dpojax.main" in argv and wanted <= set(argv):
            pids.append(int(cmdline.parent.name))
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.newest  # the coordination service's failure handling differs by JAX release
def test_two_processes_equal_one_a_killed_process_stops_all_and_a_restart_resumes_exactly(
    assets, tmp_path
):
    """2 processes x 2 CPU devices, mesh data=2 x fsdp=2 (FSDP across processes) against one
    process x 4 devices. Process 1 is killed mid-run: process 0 stops at once with a message; the
    restart resumes from the last checkpoint and recomputes the lost steps bit for bit."""
    args = [
        *assets,
        "--config.mesh.data=2",
        "--config.mesh.fsdp=2",
        "--config.train.steps=16",
        "--config.train.eval_every=8",
        "--config.train.progress=True",
        "--config.train.report_plots=False",
        "--config.distributed.heartbeat_timeout_seconds=10",
        "--verbosity=1",  # DEBUG: the pairs each step reads
    ]
    single_log = _single(tmp_path / "single", 4, *args)
    work = tmp_path / "multi"
    launcher = _launch(work, 2, 2, *args, background=True)
    killed_at = None
    while launcher.poll() is None and time.time() < (killed_at or time.time()) + 120:
        if killed_at is None and len(_records(work)) >= 4:
            _kill_process(work, 1)
            killed_at, lost = time.time(), max(_records(work))
        time.sleep(0.1)
    assert killed_at is not None, "the run ended before process 1 could be killed"
    stopped_after = time.time() - killed_at
    assert launcher.wait(timeout=5) != 0 and stopped_after < 30
    assert "process 1 failed first" in launcher.stderr.read()
    log0 = (work / "logs" / "process_0.log").read_text()
    # jax >= 0.11's coordination service may end the survivor itself when the heartbeats stop,
    # before the failed collective reaches dpojax (seen with jax 0.12.0.1 on Python 3.12): then
    # its own fatal line names the cause instead of dpojax's.
    terminated_by_jax = jax.__version_info__ >= (0, 11) and (
        "Terminating process because the JAX distributed service detected fatal errors" in log0
    )
    assert terminated_by_jax or re.search(
        r"dpojax: error: \[process 0/2\] an operation across the processes failed .*another "
        r"process has probably stopped or crashed",
        log0,
    )
    before = _records(work)
    _launch(work, 2, 2, *args)  # the same command again
    logs = [(work / "logs" / f"process_{i}.log").read_text() for i in range(2)]
    resumed = [int(re.search(r"resumed from .* at step (\d+)", log)[1]) for log in logs]
    assert resumed[0] == resumed[1] and 2 <= resumed[0] <= lost
    after = _records(work)
    redone = {s: before[s] for s in before if s > resumed[0]}
    print(
        f"killed after step {lost}, all stopped {stopped_after:.1f} s later, resumed at step "
        f"{resumed[0]}, steps {sorted(redone)} recomputed"
    )
    assert redone and _max_diff(redone, {s: after[s] for s in redone}) == 0.0  # bit for bit

    # Equal to one process with the same global mesh (float32 summation order).
    single = tmp_path / "single"
    train_diff = _max_diff(_records(single), after)
    eval_diff = _max_diff(_records(single, "eval"), _records(work, "eval"))
    loss_diff = max(abs(_records(single)[s]["loss"] - after[s]["loss"]) for s in after)
    weight_diff = _max_weight_diff(
        single / "export" / "model.safetensors", work / "export" / "model.safetensors"
    )
    print(
        f"2 processes vs 1: loss {loss_diff:.2e}, any train metric {train_diff:.2e}, "
        f"eval {eval_diff:.2e}, exported weights {weight_diff:.2e}"
    )
    assert loss_diff < 1e-5 and train_diff < 1e-3 and eval_diff < 1e-3 and weight_diff < 1e-5

    # Each process read its own half of each step's pairs: those the single process read.
    reads = [_pairs_read(log) for log in logs]
    alone = _pairs_read(single_log)
    assert sorted(reads[0]) == sorted(reads[1]) == list(range(resumed[0] + 1, 17))
    for step in reads[0]:
        assert len(reads[0][step]) == len(reads[1][step]) == 2
        assert sorted(reads[0][step] + reads[1][step]) == sorted(alone[step])
    # The same data position in the last checkpoints; every process wrote its shards.
    extra = [
        json.loads((w / "checkpoints" / "16" / "extra" / "metadata").read_text())
        for w in (single, work)
    ]
    assert [(e["data"]["epoch"], e["data"]["step"]) for e in extra] == [(2, 4)] * 2
    state = work / "checkpoints" / "16" / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    # One progress report (process 0's: a plain line where stderr is no terminal, at the last step
    # too); the process index on every dpojax log line.
    assert re.search(r"train: step 16 of 16 \(100%\)", logs[0])
    assert not re.search(r"train: step \d+ of", logs[1])
    for i, log in enumerate(logs):
        # Python's records (`time level [logger: ]message`; not XLA's C++ lines)
        python_line = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
        lines = [x for x in log.splitlines() if re.match(python_line, x)]
        assert lines and all(f" [process {i}/2] " in x for x in lines)
    assert json.loads((work / "summary.json").read_text())["status"] == "completed"


def test_four_processes_share_the_tensor_axis_lora_precomputed_reference(assets, tmp_path):
    """4 processes x 1 CPU device, mesh data=2 x tensor=2: the tensor axis spans processes, so
    two processes feed each half of the batch. LoRA with a precomputed reference (one pass over
    all processes before training), evaluation, export of the merged model and the PEFT adapter
    from gathered weights: all equal to one process x 4 devices."""
    args = [
        *assets,
        "--config.mesh.data=2",
        "--config.mesh.tensor=2",
        "--config.lora.rank=4",
        "--config.reference.type=precomputed",
        "--config.train.steps=4",
        "--config.train.eval_every=2",
        "--config.checkpoint.every_steps=100",
        "--config.train.report_plots=False",
    ]
    _single(tmp_path / "single", 4, *args)
    work = tmp_path / "multi"
    _launch(work, 4, 1, *args)
    single = tmp_path / "single"
    logs = [(work / "logs" / f"process_{i}.log").read_text() for i in range(4)]
    for i, log in enumerate(logs):
        assert f"data partition {i // 2} of 2: 2 of 4 pairs per micro-batch" in log
        assert "reference log-probs for train: computed" in log
    assert len(list((work / "reference_cache").glob("*.npz"))) == 2  # train and eval, once each
    train_diff = _max_diff(_records(single), _records(work))
    eval_diff = _max_diff(_records(single, "eval"), _records(work, "eval"))
    merged = _max_weight_diff(
        single / "export" / "model.safetensors", work / "export" / "model.safetensors"
    )
    adapter = _max_weight_diff(
        single / "export" / "adapter" / "adapter_model.safetensors",
        work / "export" / "adapter" / "adapter_model.safetensors",
    )
    print(
        f"4 processes vs 1: any train metric {train_diff:.2e}, eval {eval_diff:.2e}, "
        f"merged weights {merged:.2e}, adapter {adapter:.2e}"
    )
    assert train_diff < 1e-3 and eval_diff < 1e-3 and merged < 1e-5 and adapter < 1e-5
    assert (work / "export_best" / "config.json").is_file()


def test_loop_mode_collects_each_run_on_one_process(tmp_path):
    """mode=loop over 2 processes: run i of each round on process i mod 2; every process gets the
    events of every run, and round 1's events equal a one-process collection's."""
    from dpojax.config import default_config
    from dpojax.jobs.rounds import collection

    plugin = "tests.helpers.plugin_workflow:CountingWorkflow"
    overrides = {
        "mode": "loop",
        "collect.workflow": plugin,
        "collect.num_runs": 2,
        "collect.max_new_tokens": 3,
        "collect.min_score_diff": 0.5,
        "loop.rounds": 2,
        "loop.best_metric": "mean_length",
        "loop.replay_rounds": -1,
        "data.max_length": 32,
        "train.steps": 2,
        "checkpoint.every_steps": 100,
        "train.report_plots": False,
        "mesh.data": 2,
        "mesh.fsdp": 2,
    }
    work = tmp_path / "loop"
    _launch(work, 2, 2, f"--config={RECIPE}", *(f"--config.{k}={v}" for k, v in overrides.items()))
    logs = [(work / "logs" / f"process_{i}.log").read_text() for i in range(2)]
    for r in (1, 2):
        assert f"round {r}: collection runs [0] of 2 here" in logs[0]
        assert f"round {r}: collection runs [1] of 2 here" in logs[1]
    summary = json.loads((work / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2]
    assert (work / "export" / "config.json").is_file()

    config = default_config()
    for key, value in overrides.items():
        group, _, name = key.rpartition(".")
        (config[group] if group else config)[name] = value
    config.collect.workflow = plugin
    alone = tmp_path / "alone"
    events, pairs, *_ = collection.gather_round(
        frozen(config), collection.make_workflow(frozen(config)), work / "initial_model", 1
    )
    collection.write_round(alone, events, pairs)
    assert (alone / "events.jsonl").read_text() == (work / "round_01" / "events.jsonl").read_text()
    assert (alone / "pairs.jsonl").read_text() == (work / "round_01" / "pairs.jsonl").read_text()


def test_a_process_that_cannot_join_gives_up_with_a_message(assets, tmp_path):
    """Process 1 of 2 with nobody at the coordinator's address: a message and exit code 5 after
    distributed.initialization_timeout, not a hang."""
    t0 = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpojax.main",
            *assets,
            f"--workdir={tmp_path / 'w'}",
            f"--config.distributed.coordinator_address=127.0.0.1:{_free_port()}",
            "--config.distributed.num_processes=2",
            "--config.distributed.process_id=1",
            "--config.distributed.initialization_timeout=3",
        ],
        cwd=ROOT,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 5 and time.time() - t0 < 60
    assert "dpojax: error: [process 1/2] no progress for 3 s (joining at 127.0.0.1:" in proc.stderr
    assert "not all processes joined the run" in proc.stderr


def test_watchdog_ends_a_stuck_process_with_its_stacks():
    code = (
        "import time\n"
        "from dpojax.interrupts import Watchdog\n"
        "with Watchdog(0.5, 'stuck', label='[process 3/4]') as w:\n"
        "    w.kick('step 7 of 9')\n"
        "    time.sleep(30)\n"
    )
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 5 and time.time() - t0 < 20
    assert "dpojax: error: [process 3/4] no progress for 0.5 s (step 7 of 9): stuck" in proc.stderr
    assert "time.sleep" in proc.stderr or 'File "<string>", line 5' in proc.stderr


def test_processes_started_with_different_settings_all_stop(assets, tmp_path):
    """Before: two processes of one run, one given another learning rate, both exited 0 with
    mixed weights. Now each compares its settings and data with process 0's before the first
    step, and both stop with the same line (exit 2)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dpojax.main",
                *assets,
                f"--workdir={tmp_path / 'w'}",
                f"--config.optim.learning_rate={rate}",
                "--config.train.steps=2",
                "--config.mesh.data=2",
                f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                "--config.distributed.num_processes=2",
                f"--config.distributed.process_id={i}",
            ],
            cwd=ROOT,
            env=_env(1),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, rate in enumerate((1e-4, 2e-4))
    ]
    outputs = [p.communicate(timeout=300)[1] for p in procs]
    for i, (proc, err) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"dpojax: error: [process {i}/2] process 1 has other settings")
        assert "optim.learning_rate (0.0001 vs 0.0002)" in last
    assert not (tmp_path / "w" / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "w" / "checkpoints").iterdir()
    )
