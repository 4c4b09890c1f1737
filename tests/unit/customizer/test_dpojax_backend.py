"""The local Customizer server's dpojax backend really trains: submit -> train -> HF model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dpojax.customizer.client import EXIT_OK, submit
from dpojax.customizer_server.backends import DpojaxBackend
from dpojax.models import from_pretrained
from dpojax.models.tiny import make_tiny_checkpoint
from tests.helpers.customizer import make_pairs, settings_for


@pytest.mark.slow
def test_dpojax_backend_trains_a_tiny_model_through_the_api(start_server, tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    backend = DpojaxBackend({"tiny": model_dir})  # the real dpojax training function
    server = start_server(backend)
    settings = settings_for(
        server,
        customization_config="tiny@v1",
        training_timeout_seconds=300.0,
        hyperparameters={
            "training_type": "dpo",
            "finetuning_type": "all_weights",
            "epochs": 2,
            "batch_size": 2,
            "learning_rate": 1e-3,
            "dpo": {"ref_policy_kl_penalty": 0.1},
        },
    )
    result = submit(make_pairs(10), settings, workdir=tmp_path / "run", environ={})
    assert result.exit_code == EXIT_OK, result.status
    status = result.status
    assert status.status == "completed" and status.epochs_completed == 2
    assert status.train_loss is not None and status.val_loss is not None
    assert status.train_loss < 0.6931  # it learned something from ln 2 at step 0
    output = server.store.jobs[result.job_id].output_dir
    assert output.is_relative_to(server.store.root)
    model, tokenizer = from_pretrained(output)
    assert model.config.num_layers == 2 and tokenizer is not None
    original, _ = from_pretrained(model_dir, tokenizer=False)
    assert not np.array_equal(
        np.asarray(model.layers[0].mlp.up_proj.kernel[...]),
        np.asarray(original.layers[0].mlp.up_proj.kernel[...]),
    )


def _wait(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
def test_real_training_reports_every_step_and_cancels_within_one_step(start_server, tmp_path):
    """Before: train() reported once, at the end (and only with validation data): a job showed 0%
    until it completed, and a cancelled job ran all its steps in `cancelling`."""
    import httpx

    from tests.unit.customizer.test_hostile_requests import _job_body, _upload_dataset

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=0)
    backend = DpojaxBackend({"tiny": model_dir})
    server = start_server(backend)
    _upload_dataset(server.url, "ns", "ds")  # one pair, no validation file
    body = _job_body()
    body["hyperparameters"].update(epochs=2000, batch_size=1, learning_rate=1e-3)
    job_id = httpx.post(server.url + "/v1/customization/jobs", json=body).json()["id"]
    job = server.store.jobs[job_id]
    seen: list[int] = []

    def progressed():
        body = httpx.get(f"{server.url}/v1/customization/jobs/{job_id}/status").json()
        if body["steps_completed"] and body["steps_completed"] not in seen:
            seen.append(body["steps_completed"])
        return len(seen) >= 4

    _wait(progressed)
    assert seen == sorted(seen) and seen[-1] < 2000
    assert max(b - a for a, b in zip(seen, seen[1:], strict=False)) <= 5  # every few steps
    status = httpx.get(f"{server.url}/v1/customization/jobs/{job_id}/status").json()
    assert status["status"] == "running" and 0 < status["percentage_done"] < 1
    assert status["train_loss"] is not None
    httpx.post(f"{server.url}/v1/customization/jobs/{job_id}/cancel")
    at_cancel = job.steps_completed
    backend.join(timeout=60)
    assert job.status == "cancelled"
    assert job.steps_completed <= at_cancel + 1, (at_cancel, job.steps_completed)
    assert not (job.output_dir / "config.json").exists()
