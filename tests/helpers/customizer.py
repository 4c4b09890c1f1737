"""Fixtures: the local Customizer server on 127.0.0.1 at a free port, settings pointing at it.

`start_server(token=TOKEN)` starts one that needs the bearer token; `settings_for` sends TOKEN
(`customizer.hf_token`) to both hosts, and `AUTH` is the header for direct requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nemo_microservices")
pytest.importorskip("huggingface_hub")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dpojax.customizer_server import ServerHandle, serve_in_thread  # noqa: E402
from dpojax.customizer_server.backends import SimulateBackend, TrainingBackend  # noqa: E402
from dpojax.data.pairs import PreferencePair  # noqa: E402

TOKEN = "hf_TestSecretToken_5f9c2a7e41"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = "meta/llama-3.2-1b-instruct@v1.0.0+A100"
MESSAGES = [
    {"role": "system", "content": "You play X."},
    {"role": "user", "content": "  1 2 3\n1 _ _ _\n2 _ _ _\n3 _ _ _"},
]


def make_pairs(n: int = 7) -> list[PreferencePair]:
    """`n` pairs mixing string and message prompts, with non-ASCII text and NAT metadata."""
    out = []
    for i in range(n):
        prompt: Any = f"Quelle est la réponse {i}?" if i % 2 else MESSAGES
        out.append(
            PreferencePair(
                prompt,
                f"<move>{i}</move>",
                f"<move>{i + 1}</move> ünï",
                {"example_id": str(i // 2), "reward": 0.5 + i},
            )
        )
    return out


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerHandle]]:
    """Factory: start a server (stopped after the test); kwargs go to `serve_in_thread`
    (`token=TOKEN` for one that needs the token; `root=` to start again on an earlier root)."""
    handles: list[ServerHandle] = []

    def start(backend: TrainingBackend | None = None, **kwargs: Any) -> ServerHandle:
        kwargs.setdefault("admin", True)
        kwargs.setdefault("deployment_ready_seconds", 0.1)
        root = kwargs.pop("root", None) or tmp_path / f"server{len(handles)}"
        handle = serve_in_thread(root, backend or SimulateBackend(seconds_per_epoch=0.05), **kwargs)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()


@pytest.fixture
def server(start_server: Callable[..., ServerHandle]) -> ServerHandle:
    """A simulate-backend server with admin endpoints, 0.05 s per epoch."""
    return start_server()


def settings_for(server: ServerHandle, **overrides: Any) -> dict[str, Any]:
    """Fast `customizer.*` settings for `server` (short polls and backoffs)."""
    values: dict[str, Any] = {
        "entity_host": server.url,
        "datastore_host": server.url + "/",
        "namespace": "dpo-test",
        "customization_config": CONFIG,
        "hf_token": TOKEN,
        "poll_interval_seconds": 0.02,
        "retry_backoff_seconds": 0.01,
        "request_timeout_seconds": 5.0,
        "training_timeout_seconds": 20.0,
        "deployment_timeout_seconds": 5.0,
        # batch 1: the server refuses a batch larger than the training records (2 pairs: 1)
        "hyperparameters": {"epochs": 2, "batch_size": 1},
    }
    values.update(overrides)
    return values


def assert_no_secret(where: Path, *texts: str, secret: str = TOKEN) -> None:
    """No file under `where` and none of `texts` contains `secret`."""
    files = [p for p in where.rglob("*") if p.is_file()]
    assert files, f"nothing written under {where}"
    for path in files:
        assert secret.encode() not in path.read_bytes(), f"token leaked into {path}"
    for text in texts:
        assert secret not in text
