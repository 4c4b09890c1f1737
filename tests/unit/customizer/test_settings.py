"""`customizer.*` settings validation, status mapping and token handling (no server)."""

from __future__ import annotations

import logging

import pytest

from dpojax.customizer.client import CustomizerSettings, JobStatus, SettingsError, map_status
from dpojax.customizer.client.auth import (
    Redactor,
    is_loopback,
    plain_http_warning,
    resolve_hf_token,
)

BASE = {
    "entity_host": "http://nemo.example:8000/",
    "datastore_host": "https://datastore.example",
    "namespace": "team",
    "customization_config": "meta/llama-3.2-1b-instruct@v1.0.0+A100",
}


def test_defaults_mirror_nat_and_hosts_lose_the_trailing_slash():
    s = CustomizerSettings.from_mapping(BASE)
    assert s.entity_host == "http://nemo.example:8000"
    assert s.hyperparameters.to_payload() == {
        "training_type": "dpo",
        "finetuning_type": "all_weights",
        "epochs": 3,
        "batch_size": 4,
        "learning_rate": 5e-05,
        "dpo": {
            "ref_policy_kl_penalty": 0.1,
            "preference_loss_weight": 1.0,
            "preference_average_log_probs": False,
            "sft_loss_weight": 0.0,
        },
    }
    assert (s.poll_interval_seconds, s.deployment_timeout_seconds) == (30.0, 1800.0)
    assert s.max_consecutive_status_failures == 3 and s.training_timeout_seconds > 0


def test_accepts_an_object_with_to_dict():
    class Config:
        def to_dict(self):
            return {**BASE, "hyperparameters": {"training_type": "sft", "finetuning_type": "lora"}}

    s = CustomizerSettings.from_mapping(Config())
    assert (s.hyperparameters.training_type, s.hyperparameters.finetuning_type) == ("sft", "lora")


def test_every_bad_key_is_named():
    bad = {
        **BASE,
        "entity_host": "nemo.example",
        "namespace": "",
        "poll_interval_seconds": 0,
        "max_consecutive_status_failures": 11,
        "deploy_on_completion": "yes",
        "hyperparameters": {"training_type": "ppo", "epochs": 0, "dpo": {"beta": 0.1}},
        "deployment_config": {"gpu": 0},
        "cancel_on_interrupt": "maybe",
        "typo_key": 1,
    }
    with pytest.raises(SettingsError) as info:
        CustomizerSettings.from_mapping(bad)
    text = str(info.value)
    for key in (
        "customizer.entity_host",
        "customizer.namespace: is required",
        "customizer.poll_interval_seconds",
        "customizer.max_consecutive_status_failures",
        "customizer.deploy_on_completion",
        "customizer.hyperparameters.training_type",
        "customizer.hyperparameters.epochs",
        "customizer.hyperparameters.dpo.beta: unknown key",
        "customizer.deployment_config.gpu",
        "customizer.cancel_on_interrupt",
        "customizer.typo_key: unknown key",
    ):
        assert key in text, key
    assert info.value.exit_code == 2


def test_required_keys_and_token_value_never_shown():
    with pytest.raises(SettingsError) as info:
        CustomizerSettings.from_mapping({"hf_token": 123456789})
    text = str(info.value)
    assert "customizer.entity_host: is required" in text and "123456789" not in text
    s = CustomizerSettings.from_mapping({**BASE, "hf_token": "hf_abcdefgh"})
    assert "hf_abcdefgh" not in repr(s) and s.to_dict()["hf_token"] == "***"


def test_status_mapping_and_missing_fields():
    assert [map_status(s) for s in ("created", "pending", "running", "completed", "ready")] == [
        "pending",
        "pending",
        "running",
        "completed",
        "completed",
    ]
    assert [map_status(s) for s in ("failed", "cancelled", "canceled", "cancelling", None)] == [
        "failed",
        "canceled",
        "canceled",
        "running",
        "running",
    ]
    st = JobStatus.from_details({"status": "running"}, epochs=3)
    assert st.progress is None and st.message == "Status: running"
    st = JobStatus.from_details({"status": "running", "epochs_completed": 1}, epochs=4)
    assert st.progress == 25.0
    st = JobStatus.from_details(
        {"status": "failed", "status_logs": [{"message": "training failed", "detail": "OOM"}]}
    )
    assert st.terminal and st.reason == "training failed: OOM"


def test_token_resolution_and_plain_http_warning():
    assert resolve_hf_token("conf", {"HF_TOKEN": "env"}) == "conf"
    assert resolve_hf_token("", {"HF_TOKEN": "env"}) == "env"
    assert resolve_hf_token("  ", {}) is None
    assert (
        is_loopback("http://127.0.0.1:9")
        and is_loopback("http://localhost")
        and is_loopback("http://[::1]:8")
    )
    assert plain_http_warning("http://10.0.0.5:3000", "tok") is not None
    assert plain_http_warning("https://10.0.0.5:3000", "tok") is None
    assert plain_http_warning("http://127.0.0.1:3000", "tok") is None
    assert plain_http_warning("http://10.0.0.5:3000", None) is None


def test_warning_logged_before_token_goes_over_plain_http(tmp_path, caplog):
    """The warning comes first; the run then stops at the (loopback, closed) Entity Store, so
    nothing is ever sent to the non-loopback Datastore."""
    import socket

    from dpojax.customizer.client import ServiceUnreachableError, submit
    from tests.helpers.customizer import TOKEN, make_pairs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = {
        **BASE,
        "entity_host": closed,
        "datastore_host": "http://datastore.example:3000",
        "hf_token": TOKEN,
        "max_retries": 0,
    }
    caplog.set_level(logging.WARNING)
    with pytest.raises(ServiceUnreachableError):
        submit(make_pairs(2), settings, workdir=tmp_path, environ={})
    messages = [r.getMessage() for r in caplog.records]
    assert "plain http to datastore.example:3000" in messages[0]
    assert TOKEN not in caplog.text


def test_redactor_masks_text_values_and_log_records():
    r = Redactor(["hf_secret_value", None, ""])
    assert r.text("a hf_secret_value b") == "a *** b"
    assert r.value({"k": ["hf_secret_value"], "hf_secret_value": 1}) == {"k": ["***"], "***": 1}
    record = logging.LogRecord("x", logging.INFO, "f", 1, "token=%s", ("hf_secret_value",), None)
    assert r.filter(record) and record.getMessage() == "token=***"
