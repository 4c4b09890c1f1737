"""Models by Hugging Face Hub id: from a pre-populated huggingface_hub cache (offline) and from an
HF-compatible endpoint on 127.0.0.1 (HF_ENDPOINT), with revisions, private repositories
(HF_TOKEN) and the errors a user sees. No test reaches the internet."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dpojax.models import from_pretrained
from dpojax.models.hub import HubError, is_hub_id, resolve_model_dir, split_revision
from dpojax.models.safetensors_io import ModelFileError
from dpojax.models.tiny import make_tiny_checkpoint
from tests.helpers.hub_server import HubServer

huggingface_hub = pytest.importorskip("huggingface_hub")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "qwen3", seed=4)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A fresh Hugging Face home, online, no token."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf_home" / "hub"


def _logits(model, vocab: int) -> np.ndarray:
    tokens = np.random.default_rng(0).integers(0, vocab, size=(1, 12))
    return np.asarray(model(jnp.asarray(tokens)))


def _write_cache(cache: Path, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
    """huggingface_hub's cache layout: blobs by content hash, a snapshot of links per commit and
    a ref naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repr(sorted(files)).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


def test_hub_ids_are_told_from_local_paths(tmp_path):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id("google/gemma-2-2b-it@main")
    assert split_revision("org/name@v1.0") == ("org/name", "v1.0")
    assert split_revision("org/name") == ("org/name", None)
    assert not is_hub_id("just-a-name") and not is_hub_id("a/b/c") and not is_hub_id("../x")
    assert not is_hub_id("pairs/train.jsonl")  # a missing local file, not a Hub id
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id(str(tmp_path / "org" / "name"))  # an existing path is local
    with pytest.raises(ModelFileError, match="not a directory and not a Hugging Face Hub id"):
        resolve_model_dir(tmp_path / "missing" / "model" / "dir")


@pytest.mark.slow
def test_model_from_a_prepopulated_cache_offline(tiny, hub_env, monkeypatch):
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    _write_cache(hub_env, "acme/tiny-qwen3", files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: must not be used
    model, tokenizer = from_pretrained("acme/tiny-qwen3")
    local, _ = from_pretrained(tiny, tokenizer=False)
    vocab = model.config.vocab_size
    np.testing.assert_array_equal(_logits(model, vocab), _logits(local, vocab))
    assert tokenizer("Your move:")["input_ids"][0] == tokenizer.bos_token_id
    with pytest.raises(HubError) as info:
        from_pretrained("acme/not-downloaded")
    message = str(info.value)
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    assert "hf download acme/not-downloaded" in message


@pytest.mark.slow
def test_model_from_a_local_endpoint_with_revision_and_token(tiny, hub_env, monkeypatch):
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    server = HubServer(token="hf_secret")
    server.add_repo("model", "acme/tiny", files)
    other = make_tiny_checkpoint(hub_env.parent / "other", "qwen3", seed=9)
    server.add_repo("model", "acme/tiny", other, revision="v2")
    server.add_repo(
        "model", "acme/private", {**files, "pytorch_model.bin": b"ignored"}, private=True
    )
    with server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        main, _ = from_pretrained("acme/tiny", tokenizer=False)
        v2, _ = from_pretrained("acme/tiny@v2", tokenizer=False)
        local, _ = from_pretrained(tiny, tokenizer=False)
        vocab = main.config.vocab_size
        np.testing.assert_array_equal(_logits(main, vocab), _logits(local, vocab))
        assert not np.allclose(_logits(v2, vocab), _logits(main, vocab))
        with pytest.raises(HubError, match="revision 'v9' does not exist"):
            resolve_model_dir("acme/tiny@v9")

        with pytest.raises(HubError, match="does not exist on .* set HF_TOKEN"):
            resolve_model_dir("acme/private")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        path = resolve_model_dir("acme/private")
        assert ("GET", "/api/models/acme/private/revision/main", "Bearer hf_secret") in (
            server.requests
        )
    # only what a load needs: no PyTorch weights
    assert sorted(p.name for p in path.iterdir()) == sorted(files)
    # the cache now answers offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir("acme/tiny") == resolve_model_dir("acme/tiny")
    np.testing.assert_array_equal(
        _logits(from_pretrained("acme/tiny", tokenizer=False)[0], vocab), _logits(local, vocab)
    )


def test_config_accepts_hub_ids_and_names_bad_paths():
    from dpojax.config import default_config, validate

    c = default_config()
    c.data.train_path = "Anthropic/hh-rlhf"
    c.model.path = "Qwen/Qwen2.5-0.5B-Instruct@main"
    assert validate(c) == []
    c.model.path = "/no/such/model/dir"
    c.data.train_path = "/no/such/pairs.jsonl"
    errors = validate(c)
    assert any("'model.path'" in e and "neither a directory nor a Hub id" in e for e in errors)
    assert any("'data.train_path'" in e and "does not exist" in e for e in errors)


def test_the_offline_message_keeps_the_revision(hub_env, monkeypatch):
    """Before: for org/name@v9 the message said `hf download org/name`, which fetches main."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError) as info:
        resolve_model_dir("acme/not-downloaded@v9")
    assert "`hf download acme/not-downloaded --revision v9`" in str(info.value)
