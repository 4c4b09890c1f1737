"""The full submit flow with the real NeMo SDK and huggingface_hub against the local server."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from dpojax.customizer.client import EXIT_OK, submit
from dpojax.customizer_server.backends import SimulateBackend
from dpojax.data.pair_files import customizer_jsonl, customizer_record, customizer_split
from tests.helpers.customizer import CONFIG, TOKEN, assert_no_secret, make_pairs, settings_for

NAT_FINAL_METRICS_KEYS = [
    "run_id",
    "timestamp",
    "status",
    "message",
    "progress",
    "num_collection_runs",
    "total_trajectory_groups",
    "collection_summary",
    "job_metadata",
]


def _auth(token: str) -> str:
    return "bearer:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def test_full_flow_stores_files_creates_job_polls_and_deploys(start_server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    server = start_server(  # 0.2 s per epoch: polled more than once, even on a loaded host
        SimulateBackend(seconds_per_epoch=0.2),
        max_page_size=2,
        deployment_ready_seconds=0.15,
        token=TOKEN,
    )
    for i in range(5):  # other teams' deployments, so ours lands on a later page
        server.store.add_deployment({"name": f"other-{i}", "namespace": "elsewhere"})
    pairs = make_pairs(7)
    settings = settings_for(
        server,
        deploy_on_completion=True,
        use_full_message_history=True,
        deployment_config={"image_name": "nvcr.io/nim/x", "gpu": 2, "deployment_name": "my-dep"},
        hyperparameters={
            "training_type": "dpo",
            "finetuning_type": "lora",
            "epochs": 3,
            "batch_size": 4,
            "dpo": {"ref_policy_kl_penalty": 0.2},
        },
    )
    workdir = tmp_path / "run"
    result = submit(pairs, settings, workdir=workdir, run_id="run_abc", environ={})

    # -- outcome
    assert result.exit_code == EXIT_OK and result.status.status == "completed"
    assert result.status.progress == 100.0 and result.status.epochs_completed == 3
    assert [h.status for h in result.history][-1] == "completed"
    assert len(result.history) >= 2  # polled more than once

    # -- files: NAT's records, ordered 80/20 split, stored on the server under its root
    records = [customizer_record(p, use_full_message_history=True) for p in pairs]
    train, val = customizer_split(records)
    assert (len(train), len(val)) == (5, 2)
    state = server.store.snapshot()
    repo = state["repos"]["dataset:dpo-test/dpojax-dpo"]
    stored = {
        p: (server.store.root / "datastore/datasets/dpo-test/dpojax-dpo" / p).read_text()
        for p in repo["files"]
    }
    assert stored == {
        "training/training_file.jsonl": customizer_jsonl(train),
        "validation/validation_file.jsonl": customizer_jsonl(val),
    }
    assert result.training_file.read_text() == customizer_jsonl(train)
    # one commit per file, in NAT's order and wording: nothing uploaded twice
    assert [(c["paths"], c["summary"]) for c in repo["commits"]] == [
        (["training/training_file.jsonl"], "Training file for run run_abc"),
        (["validation/validation_file.jsonl"], "Validation file for run run_abc"),
    ]

    # -- namespaces, dataset, job payload
    assert state["namespaces"] == ["dpo-test"] and state["datastore_namespaces"] == ["dpo-test"]
    assert (
        state["datasets"]["dpo-test/dpojax-dpo"]["files_url"] == "hf://datasets/dpo-test/dpojax-dpo"
    )
    (job,) = state["jobs"].values()
    assert job["payload"] == {
        "config": CONFIG,
        "dataset": {"name": "dpojax-dpo", "namespace": "dpo-test"},
        "hyperparameters": {
            "training_type": "dpo",
            "finetuning_type": "lora",
            "epochs": 3,
            "batch_size": 4,
            "learning_rate": 5e-05,
            "dpo": {
                "ref_policy_kl_penalty": 0.2,
                "preference_loss_weight": 1.0,
                "preference_average_log_probs": False,
                "sft_loss_weight": 0.0,
            },
        },
    }
    assert job["status"] == "completed" and job["output_model"] == result.output_model

    # -- deployment: config names the output model; readiness found past the first page
    (cfg,) = state["deployment_configs"].values()
    assert cfg["model"] == result.output_model
    assert cfg["nim_deployment"] == {"image_name": "nvcr.io/nim/x", "image_tag": "latest", "gpu": 2}
    assert state["deployments"]["dpo-test/my-dep"]["status_details"]["status"] == "ready"
    assert result.deployment["status"] == "ready"
    pages = {
        r["query"]
        for r in server.store.requests
        if r["path"].endswith("model-deployments") and r["method"] == "GET"
    }
    assert any("page=2" in q for q in pages) and any("page=3" in q for q in pages)

    # -- headers: the server needs the token, and every call carries it (the SDK's too: before,
    # it sent none, and a server with a token refused the submission with 401)
    auths = {(r["path"].split("/")[2], r["auth"]) for r in server.store.requests}
    assert {"hf", "datastore", "namespaces", "customization", "deployment"} <= {p for p, _ in auths}
    assert {a for _, a in auths} == {_auth(TOKEN)}
    assert not any(r["status"] == 401 for r in server.store.requests)

    # -- NAT-compatible artifacts
    final = json.loads((workdir / "final_metrics.json").read_text())
    assert list(final)[: len(NAT_FINAL_METRICS_KEYS)] == NAT_FINAL_METRICS_KEYS
    assert final["status"] == "completed" and final["exit_code"] == 0
    assert final["job_metadata"] == {
        "job_id": result.job_id,
        "output_model": result.output_model,
        "dataset_name": "dpojax-dpo",
    }
    assert final["num_collection_runs"] == 1 and final["total_trajectory_groups"] == 4
    assert final["collection_summary"]["total_dpo_pairs"] == 7
    submission = json.loads((workdir / "submission.json").read_text())
    assert (
        submission["backend"] == "nemo-customizer" and submission["settings"]["hf_token"] == "***"
    )
    statuses = [
        json.loads(line) for line in (workdir / "job_status.jsonl").read_text().splitlines()
    ]
    assert statuses[-1]["status"] == "completed"
    assert "Training completed with status: completed" in (workdir / "customizer.log").read_text()

    # -- the secret is nowhere: not in the workdir, the server's files, or any log record
    assert_no_secret(workdir, caplog.text)
    assert_no_secret(server.store.root)


def test_no_token_means_no_authorization_header(server, tmp_path):
    result = submit(make_pairs(3), settings_for(server, hf_token=""), workdir=tmp_path, environ={})
    assert result.status.status == "completed"
    assert {r["auth"] for r in server.store.requests} == {"none"}


def test_token_from_hf_token_environment_variable(server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    env_token = "hf_FromEnvironment_0a1b2c3d"
    result = submit(
        make_pairs(2),
        settings_for(server, hf_token=""),
        workdir=tmp_path,
        environ={"HF_TOKEN": env_token},
    )
    assert result.status.status == "completed"
    hf_auth = {r["auth"] for r in server.store.requests if r["path"].startswith("/v1/hf")}
    assert hf_auth == {_auth(env_token)}
    assert_no_secret(tmp_path, caplog.text, secret=env_token)


def test_server_message_echoing_the_token_is_redacted(server, tmp_path, caplog):
    server.faults.configure(
        {
            "rules": [
                {
                    "path": "/v1/customization/jobs$",
                    "method": "POST",
                    "status": 400,
                    "message": f"invalid credentials {TOKEN}",
                }
            ]
        }
    )
    from dpojax.customizer.client import RequestRejectedError

    with pytest.raises(RequestRejectedError) as info:
        submit(make_pairs(2), settings_for(server), workdir=tmp_path, environ={})
    assert "invalid credentials ***" in str(info.value)
    assert_no_secret(tmp_path, caplog.text, str(info.value))


def test_wait_for_completion_off_returns_after_submit(server, tmp_path):
    result = submit(
        make_pairs(2), settings_for(server, wait_for_completion=False), workdir=tmp_path, environ={}
    )
    assert result.job_id and result.status.status == "running"
    assert not any(r["path"].endswith("/status") for r in server.store.requests)
