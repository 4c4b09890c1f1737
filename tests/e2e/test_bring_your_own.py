"""End to end, as the README's "Train on your own model and data" runs it: a model and a dataset by
Hub id (served by an HF-compatible endpoint on 127.0.0.1), conversational UltraFeedback-shaped
records with a train and a test split, a chat template and its arguments from the config, metrics
to TensorBoard, W&B (offline) and MLflow (a local file store), and the trained model pushed back
to the endpoint with its model card. Nothing leaves the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpojax.models.tiny import make_tiny_checkpoint
from tests.helpers.hub_server import HubServer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "tiny_test.py")
datasets = pytest.importorskip("datasets")
pytest.importorskip("huggingface_hub")

# ChatML-style, with a system default and an optional thought block
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def _records(n: int, offset: int) -> list[dict]:
    out = []
    for i in range(offset, offset + n):
        user = {"role": "user", "content": f"Board {i % 9}: your move?"}
        out.append(
            {
                "prompt": user["content"],
                "chosen": [user, {"role": "assistant", "content": f"I play {i % 9 + 1}."}],
                "rejected": [user, {"role": "assistant", "content": "I pass."}],
                "score_chosen": 9.0,
                "score_rejected": 1.0,
            }
        )
    return out


def _dataset_repo(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train_prefs\n    path: data/train_prefs-*.parquet\n"
        "  - split: test_prefs\n    path: data/test_prefs-*.parquet\n---\n"
    )
    train, test = _records(16, 0), _records(4, 100)
    datasets.Dataset.from_list(train).to_parquet(str(root / "data" / "train_prefs-0.parquet"))
    datasets.Dataset.from_list(test).to_parquet(str(root / "data" / "test_prefs-0.parquet"))
    return root


def _cli(workdir: Path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dpojax.main", f"--config={RECIPE}", f"--workdir={workdir}"]
    return subprocess.run(
        [*cmd, *overrides],
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )


def test_hub_model_and_dataset_to_trackers_and_back_to_the_hub(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    model = make_tiny_checkpoint(tmp_path / "model", "qwen3", seed=0)
    server = HubServer(token="hf_test")
    server.add_repo("model", "acme/tiny-qwen3", model)
    server.add_repo("dataset", "acme/prefs", _dataset_repo(tmp_path / "prefs"))
    template = tmp_path / "chat_template.jinja"
    template.write_text(TEMPLATE)
    work = tmp_path / "run"
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_TOKEN": "hf_test",
        "HF_HUB_OFFLINE": "0",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    overrides = [
        "--config.model.path=acme/tiny-qwen3",
        "--config.data.train_path=acme/prefs",
        "--config.data.train_split=train_prefs",
        "--config.data.eval_split=test_prefs",
        f"--config.data.chat_template={template}",
        '--config.data.chat_template_kwargs={"enable_thinking": false}',
        "--config.data.system_prompt=You play tic-tac-toe.",
        "--config.train.steps=4",
        "--config.train.eval_every=0",
        "--config.train.report_to=tensorboard,wandb,mlflow",
        "--config.export.push_to_hub=acme/tiny-qwen3-dpo",
    ]
    with server:
        env["HF_ENDPOINT"] = server.url
        proc = _cli(work, env, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 4
    assert 0.0 <= summary["final_eval"]["rewards/accuracies"] <= 1.0

    # the pushed repository: the export, its tokenizer with the configured template, the card
    repo = server.repos[("model", "acme/tiny-qwen3-dpo")]
    assert repo.private
    sha, files = repo.files("main")
    assert summary["push_to_hub"]["commit"] == sha
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    card = files["README.md"].decode()
    assert "base_model: acme/tiny-qwen3" in card and "- acme/prefs" in card
    assert "16 preference pairs" in card and "(split train_prefs)" in card
    exported = (work / "export" / "chat_template.jinja").read_text()
    assert exported == TEMPLATE and files["chat_template.jinja"].decode() == TEMPLATE

    # the trackers
    state = json.loads((work / "tracking.json").read_text())
    assert list((work / "wandb").glob(f"offline-run-*-{state['wandb']}"))
    assert list((work / "tensorboard" / "train").glob("events.out.tfevents.*"))
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the store back here
    client = MlflowClient((work / "mlruns").resolve().as_uri())
    steps = [m.step for m in client.get_metric_history(state["mlflow"], "train/loss")]
    assert steps == [1, 2, 3, 4]
    assert client.get_run(state["mlflow"]).data.params["data.train_split"] == "train_prefs"

    # the model and the data came through the Hugging Face cache
    hub_cache = tmp_path / "hf" / "hub"
    assert (hub_cache / "models--acme--tiny-qwen3").is_dir()
    assert (tmp_path / "hf" / "datasets").is_dir()


def test_push_without_a_token_fails_before_any_compute(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""}
    proc = _cli(
        tmp_path / "run",
        env,
        "--config.model.path=acme/tiny",
        "--config.data.train_path=acme/prefs",
        "--config.export.push_to_hub=acme/out",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "export.push_to_hub' needs a Hugging Face token" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
