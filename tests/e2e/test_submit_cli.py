"""`python -m dpojax.main` in mode submit, against the local server (loopback only)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from dpojax.data.pair_files import write_pairs
from dpojax.errors import EXIT_SUBMIT_UNREACHABLE
from tests.helpers.customizer import make_pairs

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hf_cli_secret_token_0123456789"


def _submit(workdir, pairs_path, entity_host, *extra):
    cmd = [
        sys.executable,
        "-m",
        "dpojax.main",
        f"--config={ROOT / 'configs' / 'customizer.py'}",
        f"--workdir={workdir}",
        f"--config.data.train_path={pairs_path}",
        f"--config.customizer.entity_host={entity_host}",
        f"--config.customizer.datastore_host={entity_host}",
        "--config.customizer.poll_interval_seconds=0.05",
        "--config.customizer.retry_backoff_seconds=0.01",
        "--config.customizer.training_timeout_seconds=60",
        *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", HF_TOKEN=SECRET)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_submit_mode_end_to_end_without_leaking_the_token(start_server, tmp_path):
    server = start_server()
    write_pairs(make_pairs(6), tmp_path / "pairs.jsonl", format="customizer")
    work = tmp_path / "run"
    proc = _submit(work, tmp_path / "pairs.jsonl", server.url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(next(work.rglob("final_metrics.json")).read_text())
    assert final["status"] == "completed"
    assert SECRET not in proc.stdout + proc.stderr
    for path in list(work.rglob("*")) + list(server.store.root.rglob("*")):
        if path.is_file():
            assert SECRET not in path.read_text(errors="ignore"), path


def test_unreachable_service_has_its_own_exit_code(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    write_pairs(make_pairs(3), tmp_path / "pairs.jsonl", format="customizer")
    proc = _submit(
        tmp_path / "run",
        tmp_path / "pairs.jsonl",
        f"http://127.0.0.1:{port}",
        "--config.customizer.max_retries=1",
    )
    assert proc.returncode == EXIT_SUBMIT_UNREACHABLE == 11, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_submit_needs_customizer_keys(tmp_path):
    write_pairs(make_pairs(3), tmp_path / "pairs.jsonl", format="customizer")
    proc = _submit(tmp_path / "run", tmp_path / "pairs.jsonl", "")
    assert proc.returncode == 2
    assert "config key 'customizer.entity_host' is required for mode 'submit'" in proc.stderr


def test_submit_without_pairs_collects_tictactoe_pairs_first(start_server, tmp_path, monkeypatch):
    import importlib.util

    from dpojax.jobs import run

    monkeypatch.setenv("HF_TOKEN", SECRET)
    spec = importlib.util.spec_from_file_location("recipe", ROOT / "configs" / "customizer.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    config = recipe.get_config()
    server = start_server()
    config.customizer.entity_host = config.customizer.datastore_host = server.url
    config.customizer.poll_interval_seconds = 0.05
    config.customizer.retry_backoff_seconds = 0.01
    config.collect.tictactoe.games = 4
    config.collect.max_new_tokens = 1
    result = run(config, str(tmp_path / "run"))
    assert result.status.status == "completed"
    from dpojax.data.pair_files import read_pairs

    collected, _ = read_pairs(tmp_path / "run" / "collect" / "pairs.jsonl")
    assert collected and result.num_training + result.num_validation == len(collected)
    final = json.loads(next((tmp_path / "run").rglob("final_metrics.json")).read_text())
    assert final["num_collection_runs"] == 1
