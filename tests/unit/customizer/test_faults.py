"""Fault injection: bounded retries, no duplicate uploads or jobs, the server's message reported,
and distinct exception types / exit codes for "the job failed" vs "the service is unreachable"."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from dpojax.customizer.client import (
    EXIT_DEPLOYMENT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_REQUEST_REJECTED,
    EXIT_SERVICE_UNREACHABLE,
    EXIT_SETTINGS,
    EXIT_TRAINING_TIMEOUT,
    DeploymentError,
    JobCancelledError,
    JobFailedError,
    RequestRejectedError,
    ServiceUnreachableError,
    SubmitInterrupted,
    TrainingTimeoutError,
    submit,
)
from dpojax.customizer_server.backends import SimulateBackend
from tests.helpers.customizer import assert_no_secret, make_pairs, settings_for


def _requests(server, method, suffix):
    return [
        r for r in server.store.requests if r["method"] == method and r["path"].endswith(suffix)
    ]


def _faults(server, *rules, job=None):
    config = {"rules": list(rules)}
    if job is not None:
        config["job"] = job
    server.faults.configure(config)


def _final(workdir):
    return json.loads((workdir / "final_metrics.json").read_text())


def test_exit_codes_are_distinct():
    codes = [
        EXIT_SETTINGS,
        EXIT_JOB_FAILED,
        EXIT_SERVICE_UNREACHABLE,
        EXIT_REQUEST_REJECTED,
        EXIT_JOB_CANCELLED,
        EXIT_TRAINING_TIMEOUT,
        EXIT_DEPLOYMENT_FAILED,
        EXIT_INTERRUPTED,
    ]
    assert len(set(codes)) == len(codes) and 0 not in codes
    assert JobFailedError.exit_code == EXIT_JOB_FAILED
    assert ServiceUnreachableError.exit_code == EXIT_SERVICE_UNREACHABLE


def test_burst_of_503_on_job_create_is_retried_and_makes_one_job(server, tmp_path):
    _faults(
        server, {"path": "/v1/customization/jobs$", "method": "POST", "status": 503, "times": 2}
    )
    result = submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert [r["status"] for r in _requests(server, "POST", "/customization/jobs")] == [
        503,
        503,
        200,
    ]
    assert len(server.store.jobs) == 1


def test_burst_of_500_on_second_upload_does_not_reupload_the_first(server, tmp_path):
    _faults(server, {"path": "/commit/main$", "status": 500, "skip": 1, "times": 2})
    result = submit(make_pairs(5), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    repo = server.store.snapshot()["repos"]["dataset:dpo-test/dpojax-dpo"]
    assert [c["paths"] for c in repo["commits"]] == [
        ["training/training_file.jsonl"],
        ["validation/validation_file.jsonl"],
    ]
    assert [r["status"] for r in _requests(server, "POST", "/commit/main")] == [200, 500, 500, 200]


def test_409_on_every_create_means_already_exists(server, tmp_path):
    exists = {"status": 409, "message": "already exists", "times": -1}  # no x-should-retry header
    _faults(
        server,
        {"path": "^/v1/namespaces$", **exists},
        {"path": "^/v1/datastore/namespaces$", **exists},
        {"path": "^/v1/datasets$", **exists},
    )
    started = time.monotonic()
    result = submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    for suffix in ("/v1/namespaces", "/datastore/namespaces", "/v1/datasets"):
        assert len(_requests(server, "POST", suffix)) == 1, suffix  # not retried
    assert time.monotonic() - started < 5


def test_connection_resets_are_retried(server, tmp_path):
    _faults(
        server,
        {"path": "/repos/create$", "action": "reset", "times": 1},
        {"path": "/status$", "action": "reset", "times": 1},
    )
    result = submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert [r["status"] for r in _requests(server, "POST", "/repos/create")] == ["reset", 200]
    assert _requests(server, "GET", "/status")[0]["status"] == "reset"


def test_slow_status_response_times_out_and_is_retried(server, tmp_path):
    _faults(server, {"path": "/status$", "action": "delay", "delay_seconds": 1.5, "times": 1})
    settings = settings_for(server, request_timeout_seconds=0.4)
    result = submit(make_pairs(3), settings, workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert len(_requests(server, "GET", "/status")) >= 2


def test_status_without_percentage_done_is_handled(server, tmp_path):
    _faults(server, job={"omit_percentage_done": True})
    result = submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert result.status.progress == 100.0  # derived from epochs_completed / epochs
    assert _final(tmp_path)["status"] == "completed"


def test_failed_job_reports_the_servers_reason(server, tmp_path):
    _faults(server, job={"outcome": "failed", "message": "CUDA out of memory on rank 3"})
    with pytest.raises(JobFailedError) as info:
        submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_JOB_FAILED
    assert "CUDA out of memory on rank 3" in info.value.message
    assert info.value.result.status.status == "failed"
    final = _final(tmp_path)
    assert final["status"] == "failed" and final["exit_code"] == EXIT_JOB_FAILED
    assert "CUDA out of memory" in final["message"]


def test_job_cancelled_on_the_server(server, tmp_path):
    _faults(server, job={"outcome": "cancelled", "message": "cancelled by an administrator"})
    with pytest.raises(JobCancelledError) as info:
        submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_JOB_CANCELLED
    assert "cancelled by an administrator" in info.value.message
    assert _final(tmp_path)["status"] == "canceled"


def test_status_failures_up_to_the_limit_end_in_a_clean_failed_status(server, tmp_path):
    _faults(
        server, {"path": "/status$", "status": 503, "message": "gateway overloaded", "times": -1}
    )
    settings = settings_for(server, max_consecutive_status_failures=3)
    with pytest.raises(ServiceUnreachableError) as info:
        submit(make_pairs(3), settings, workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_SERVICE_UNREACHABLE
    assert "gateway overloaded" in info.value.message
    assert len(_requests(server, "GET", "/status")) == 3
    final = _final(tmp_path)
    assert final["status"] == "failed" and final["message"].startswith("Error getting status:")
    assert "curl -X POST" in final["message"]  # says how to cancel the job left running


def test_persistent_503_on_create_is_bounded_and_reports_the_message(server, tmp_path):
    _faults(
        server, {"path": "/customization/jobs$", "status": 503, "message": "no GPUs", "times": -1}
    )
    with pytest.raises(ServiceUnreachableError) as info:
        submit(make_pairs(3), settings_for(server, max_retries=2), workdir=tmp_path, environ={})
    assert "no GPUs" in info.value.message and "3 attempt" in info.value.message
    assert len(_requests(server, "POST", "/customization/jobs")) == 3
    assert _final(tmp_path)["exit_code"] == EXIT_SERVICE_UNREACHABLE


def test_unreachable_host_raises_service_unreachable(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = {
        "entity_host": url,
        "datastore_host": url,
        "namespace": "ns",
        "customization_config": "cfg",
        "max_retries": 1,
        "retry_backoff_seconds": 0.01,
    }
    with pytest.raises(ServiceUnreachableError) as info:
        submit(make_pairs(2), settings, workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_SERVICE_UNREACHABLE
    assert "could not be reached after 2 attempt" in info.value.message


def test_rejected_request_reports_the_servers_message(server, tmp_path):
    settings = settings_for(server, hyperparameters={"epochs": 1})
    _faults(
        server, {"path": "/customization/jobs$", "status": 422, "message": "unknown config 'x'"}
    )
    with pytest.raises(RequestRejectedError) as info:
        submit(make_pairs(3), settings, workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_REQUEST_REJECTED and info.value.status_code == 422
    assert "unknown config 'x'" in info.value.message
    assert len(_requests(server, "POST", "/customization/jobs")) == 1  # not retried


def test_overall_training_timeout_cancels_the_job(start_server, tmp_path):
    server = start_server(SimulateBackend(seconds_per_epoch=30))
    settings = settings_for(server, training_timeout_seconds=0.3)
    with pytest.raises(TrainingTimeoutError) as info:
        submit(make_pairs(3), settings, workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_TRAINING_TIMEOUT
    (job,) = server.store.jobs.values()
    assert job.status == "cancelled"
    assert len(_requests(server, "POST", "/cancel")) == 1


def test_ctrl_c_while_waiting_declined_says_how_to_cancel(start_server, tmp_path):
    server = start_server(SimulateBackend(seconds_per_epoch=30))
    calls = []

    def sleep(seconds):  # Ctrl-C on the third wait
        calls.append(seconds)
        if len(calls) == 3:
            raise KeyboardInterrupt

    asked = []
    with pytest.raises(SubmitInterrupted) as info:
        submit(
            make_pairs(3),
            settings_for(server),
            workdir=tmp_path,
            environ={},
            sleep=sleep,
            confirm_cancel=lambda job_id: asked.append(job_id) or False,
        )
    (job,) = server.store.jobs.values()
    assert asked == [job.id] and job.status == "running"
    assert info.value.exit_code == EXIT_INTERRUPTED
    assert f"curl -X POST {server.url}/v1/customization/jobs/{job.id}/cancel" in info.value.message
    assert not _requests(server, "POST", "/cancel")


def test_ctrl_c_while_waiting_accepted_cancels_the_job(start_server, tmp_path):
    server = start_server(SimulateBackend(seconds_per_epoch=30))

    def sleep(seconds):
        raise KeyboardInterrupt

    with pytest.raises(SubmitInterrupted) as info:
        submit(
            make_pairs(3),
            settings_for(server),
            workdir=tmp_path,
            environ={},
            sleep=sleep,
            confirm_cancel=lambda job_id: True,
        )
    (job,) = server.store.jobs.values()
    assert job.status == "cancelled" and "cancellation was requested" in info.value.message
    assert _final(tmp_path)["status"] == "canceled"


def test_sigterm_while_waiting_cancels_the_job(start_server, tmp_path):
    server = start_server(SimulateBackend(seconds_per_epoch=30))
    before = signal.getsignal(signal.SIGTERM)
    calls = []

    def sleep(seconds):  # a real SIGTERM to this process, sent while the job is being waited on
        calls.append(seconds)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler interrupts this
        time.sleep(seconds)

    with pytest.raises(SubmitInterrupted) as info:
        submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={}, sleep=sleep)
    assert "SIGTERM" in info.value.message and "cancellation was requested" in info.value.message
    (job,) = server.store.jobs.values()
    assert job.status == "cancelled"
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is restored


def test_failed_deployment(server, tmp_path):
    server.store.add_deployment({"name": "dep", "namespace": "dpo-test"}, forced_status="failed")
    settings = settings_for(
        server, deploy_on_completion=True, deployment_config={"deployment_name": "dep"}
    )
    with pytest.raises(DeploymentError) as info:
        submit(make_pairs(3), settings, workdir=tmp_path, environ={})
    assert info.value.exit_code == EXIT_DEPLOYMENT_FAILED and "failed" in info.value.message
    assert info.value.result.status.status == "completed"  # the training itself succeeded
    assert_no_secret(tmp_path)


def test_admin_endpoint_configures_faults(server):
    import httpx

    rules = {"rules": [{"path": "/health$", "status": 500, "message": "boom"}]}
    assert httpx.post(f"{server.url}/_admin/faults", json=rules).status_code == 200
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 500 and response.json()["detail"] == "boom"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/_admin/faults", json={"bogus": 1}).status_code == 422


def test_refused_namespace_creation_is_only_a_warning(server, tmp_path, caplog):
    _faults(server, {"path": "^/v1/namespaces$", "status": 403, "message": "not allowed here"})
    result = submit(make_pairs(3), settings_for(server), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert "not allowed here (continuing)" in caplog.text
