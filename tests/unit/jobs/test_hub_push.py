"""export.push_to_hub: the export folder and a generated model card reach a repository on an
HF-compatible endpoint on 127.0.0.1 (private by default), transient failures are retried, and a
missing token is one clear error before any compute."""

from __future__ import annotations

import pytest

from dpojax.config import default_config, validate
from dpojax.jobs.train.hub_push import (
    PushError,
    model_card,
    push_problems,
    push_to_hub,
    with_retries,
)
from tests.helpers.hub_server import HubServer

pytest.importorskip("huggingface_hub")


@pytest.fixture
def export_dir(tmp_path):
    folder = tmp_path / "export"
    (folder / "adapter").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 4096)
    (folder / "adapter" / "adapter_config.json").write_text('{"r": 4}')
    return folder


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))  # no saved token either
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "empty_hf_home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "empty_hf_home" / "t"))


def _config(**export):
    c = default_config()
    c.model.path = "Qwen/Qwen3-0.6B"
    c.data.train_path = "trl-lib/ultrafeedback_binarized"
    c.data.train_split = "train"
    c.lora.rank = 8
    c.reference.type = "lora_base"
    for k, v in export.items():
        c.export[k] = v
    return c


@pytest.mark.slow
def test_push_uploads_files_and_card_privately_with_retries(export_dir, monkeypatch):
    server = HubServer(token="hf_write")
    server.fail["/commit/"] = 2  # two 503s before the commit goes through
    monkeypatch.setenv("HF_TOKEN", "hf_write")
    config = _config(push_to_hub="acme/tiny-dpo")
    summary = {"step": 12, "final_eval": {"loss": 0.61, "rewards/accuracies": 0.75}}
    card = model_card(config, summary, pairs=96, repo_id="acme/tiny-dpo")
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        out = push_to_hub(export_dir, "acme/tiny-dpo", card=card, wait=0.01)
    repo = server.repos[("model", "acme/tiny-dpo")]
    assert repo.private
    sha, files = repo.files("main")
    assert out["commit"] == sha and out["repo"] == "acme/tiny-dpo"
    assert sorted(files) == [
        "README.md",
        "adapter/adapter_config.json",
        "config.json",
        "model.safetensors",
    ]
    assert files["model.safetensors"] == b"\x00" * 4096
    text = files["README.md"].decode()
    assert text.startswith("---\n")
    assert "base_model: Qwen/Qwen3-0.6B" in text
    assert "datasets:\n- trl-lib/ultrafeedback_binarized" in text
    assert "| rewards/accuracies | 75.0% |" in text and "96 preference pairs" in text
    assert "12 steps of 8 pairs" in text and "LoRA rank 8" in text and "`adapter/`" in text
    commits = [r for r in server.requests if r[0] == "POST" and "/commit/" in r[1]]
    assert len(commits) >= 3  # two failures, then the commit
    writes = [r for r in server.requests if r[0] == "POST" and "validate-yaml" not in r[1]]
    assert writes and all(auth == "Bearer hf_write" for _, _, auth in writes)

    # pushing again to the same repository adds a commit (the repository exists already)
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        again = push_to_hub(export_dir, "acme/tiny-dpo", card=card, wait=0.01)
    assert again["commit"] != out["commit"] and len(repo.commits) == 2


def test_model_card_metadata_reads_back_through_huggingface_hub():
    from huggingface_hub import ModelCard

    summary = {
        "step": 3,
        "final_eval": {"loss": 0.5, "preference_loss": 0.5, "acc": 1.0, "rewards/accuracies": 1.0},
    }
    text = model_card(_config(), summary, pairs=8, repo_id="acme/m")
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["tags"] == ["dpo", "dpojax"] and data["base_model"] == "Qwen/Qwen3-0.6B"
    assert data["datasets"] == ["trl-lib/ultrafeedback_binarized"]
    assert card.text.lstrip().startswith("# m\n")
    assert "| rewards/accuracies | 100.0% |" in text and "| loss | 0.5 |" in text
    assert "| acc |" not in text and "| preference_loss |" not in text  # one name per metric
    local = _config()
    local.model.path, local.data.train_path = "/models/base", "/data/pairs.jsonl"
    data = ModelCard(model_card(local, {"step": 1}, pairs=2, repo_id="a/b")).data.to_dict()
    assert "base_model" not in data and "datasets" not in data
    assert "(no evaluation ran)" in model_card(local, {"step": 1}, pairs=2, repo_id="a/b")


def test_public_push_and_errors_that_are_not_retried(export_dir, monkeypatch):
    server = HubServer(token="hf_write")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        with pytest.raises(PushError, match="creating the Hub repository acme/x failed"):
            push_to_hub(export_dir, "acme/x", card="card", wait=0.01)
        creates = [r for r in server.requests if r[1] == "/api/repos/create"]
        assert len(creates) == 1  # 401 is not transient
        monkeypatch.setenv("HF_TOKEN", "hf_write")
        push_to_hub(export_dir, "acme/public", card="card", private=False, wait=0.01)
    assert not server.repos[("model", "acme/public")].private


def test_retries_give_up_after_the_last_try():
    calls = []

    class Unavailable(Exception):
        class response:  # noqa: N801 - shaped like an HTTP error's response
            status_code = 503

    def flaky():
        calls.append(1)
        raise Unavailable("busy")

    with pytest.raises(PushError, match=r"upload failed \(Unavailable: busy\)"):
        with_retries(flaky, what="upload", tries=3, wait=0.0)
    assert len(calls) == 3


def test_missing_token_is_refused_before_any_compute(no_token):
    assert push_problems("") == []
    problems = push_problems("acme/model")
    assert problems == [
        "config key 'export.push_to_hub' needs a Hugging Face token with write access: set "
        "HF_TOKEN or run `hf auth login`"
    ]
    assert problems[0] in validate(_config(push_to_hub="acme/model"))
    assert any("not a Hub repository id" in p for p in push_problems("not a repo"))
    with pytest.raises(PushError, match="needs a token"):
        push_to_hub(__import__("pathlib").Path("."), "acme/model", card="")


def test_every_export_gets_a_card_with_its_folder_as_the_usage_line(tmp_path):
    """Before: only a push wrote README.md; an export that no one pushes had no card."""
    from dpojax.jobs.train import _write_card

    c = default_config()
    c.model.path, c.data.train_path = "org/base", "pairs.jsonl"
    export = tmp_path / "my-run" / "export"
    export.mkdir(parents=True)
    _write_card(c, export, {"step": 7, "final_eval": {"loss": 0.5}}, None)
    card = (export / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: org/base" in card
    assert "# my-run" in card and f'from_pretrained("{export}")' in card
    assert "- data: `pairs.jsonl`\n" in card  # no pair count where the export read no data
    assert "- 7 steps of" in card and "| loss | 0.5 |" in card
