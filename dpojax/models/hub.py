"""Hugging Face Hub ids for models: `org/name` or `org/name@revision` -> a local directory.

`resolve_model_dir(ref)` returns `ref` itself when it is a local directory; otherwise, when it
looks like a Hub id, the snapshot that `huggingface_hub.snapshot_download` keeps in its cache
(config, safetensors weights, tokenizer and chat-template files only: no PyTorch `.bin`, no
sub-folders). The environment is read at call time, as `huggingface_hub` reads it:

- `HF_HUB_OFFLINE=1`: only the cache is used; a model that is not there is an error that says how
  to download it;
- `HF_ENDPOINT`: another Hub (a mirror, or a server on 127.0.0.1 in the tests);
- `HF_TOKEN` (or the token saved by `hf auth login`): private and gated repositories;
- `HF_HOME` / `HF_HUB_CACHE`: where the cache lives.

The weights are then read from the snapshot like any local directory (memory-mapped, each tensor
placed straight onto its shards).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from dpojax.models.safetensors_io import ModelFileError

# org/name with an optional @revision (a branch, a tag or a commit); the characters the Hub
# allows in names.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(@[\w./-]+)?$")
# Names that end like a file are local paths (a mistyped `pairs/train.jsonl` is not a Hub id).
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt", ".safetensors", ".bin")
# What a model load needs: configs, weights, tokenizer and chat-template files (top level only).
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken")
_TRUE = ("1", "on", "yes", "true")


class HubError(ModelFileError):
    """A Hub id that cannot be resolved; the message says why and what to do."""


def is_hub_id(ref: str | os.PathLike) -> bool:
    """True when `ref` is not an existing local path and has the form org/name[@revision] (and
    does not end like a file name)."""
    text = str(ref)
    if os.path.exists(text) or ".." in text or not HUB_ID.match(text):
        return False
    return not split_revision(text)[0].lower().endswith(_FILE_SUFFIXES)


def split_revision(ref: str) -> tuple[str, str | None]:
    """`org/name@rev` -> ("org/name", "rev"); without `@`, the revision is None (main)."""
    repo_id, _, revision = ref.partition("@")
    return repo_id, revision or None


def offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def endpoint() -> str | None:
    """HF_ENDPOINT, read now; None: huggingface_hub's own default."""
    value = os.environ.get("HF_ENDPOINT", "").strip()
    return value.rstrip("/") or None


def cache_dir() -> str:
    """The Hub cache directory: HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def token() -> str | None:
    """HF_TOKEN, read now; None lets huggingface_hub use its saved token (if any)."""
    return os.environ.get("HF_TOKEN") or None


def hub_error(kind: str, ref: str, exc: Exception) -> HubError:
    """A `HubError` for a failed download of `ref` (a `kind` such as "model" or "dataset"), naming
    the cause and the fix."""
    from huggingface_hub import errors

    name = type(exc).__name__
    if isinstance(exc, errors.LocalEntryNotFoundError) or (offline() and "offline" in str(exc)):
        why = (
            f"{kind} {ref!r} is not in the Hugging Face cache ({cache_dir()}) and the Hub cannot "
            "be used (HF_HUB_OFFLINE is set or the Hub is unreachable)"
        )
        repo_id, revision = split_revision(ref)
        fix = f"download it first (`hf download {repo_id}"
        fix += f" --revision {revision}" if revision else ""
        fix += " --repo-type dataset`)" if kind == "dataset" else "`)"
        return HubError(f"{why}; {fix}, or unset HF_HUB_OFFLINE")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{kind} {ref!r}: revision {split_revision(ref)[1]!r} does not exist")
    if isinstance(exc, errors.GatedRepoError):
        return HubError(
            f"{kind} {ref!r} is gated: accept its terms on the Hub and set HF_TOKEN to a token "
            "of that account"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        hint = "" if token() else " (for a private repository set HF_TOKEN)"
        return HubError(f"{kind} {ref!r} does not exist on {endpoint() or 'the Hub'}{hint}")
    return HubError(f"{kind} {ref!r} could not be downloaded ({name}: {exc})")


def resolve_model_dir(ref: str | os.PathLike) -> Path:
    """A local directory holding the model `ref`: `ref` itself when it is a directory, else the
    cached snapshot of the Hub id `ref` (downloaded unless offline). Raises `ModelFileError`."""
    text = str(ref)
    if os.path.isdir(text):
        return Path(text)
    if not is_hub_id(text):
        raise ModelFileError(
            f"{text}: not a directory and not a Hugging Face Hub id (org/name or "
            "org/name@revision); expected a local Hugging Face model directory or a Hub id"
        )
    from huggingface_hub import snapshot_download

    repo_id, revision = split_revision(text)
    options = dict(
        revision=revision,
        cache_dir=cache_dir(),
        endpoint=endpoint(),
        token=token(),
        local_files_only=offline(),
    )
    try:  # config.json first: a checkpoint that cannot be loaded is refused before its weights
        head = Path(snapshot_download(repo_id, allow_patterns=["config.json"], **options))
    except Exception as exc:  # huggingface_hub raises many types; each becomes one clear line
        raise hub_error("model", text, exc) from None
    problem = prequantized_problem(text, _json_object(head / "config.json"))
    if problem:
        raise ModelFileError(problem)
    try:
        path = snapshot_download(
            repo_id, allow_patterns=list(MODEL_FILES), ignore_patterns=["*/*"], **options
        )
    except Exception as exc:
        raise hub_error("model", text, exc) from None
    return Path(path)


def _json_object(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def prequantized_problem(path, config: dict) -> str:
    """Why a checkpoint whose config.json (`config`) carries a `quantization_config` is refused
    ("" when it carries none)."""
    quantization_config = config.get("quantization_config")
    if quantization_config is None:
        return ""
    method = None
    if isinstance(quantization_config, dict):
        method = quantization_config.get("quant_method")
    return (
        f"{path}: config.json has a quantization_config (quant_method {method!r}): a pre-quantized "
        "checkpoint is not read. Set model.path (or reference.path) to the unquantized "
        "checkpoint (bfloat16 / float16 / float32 safetensors) and model.quantization=nf4 or "
        "int8, which quantizes it as it is read (docs/quantization.md)"
    )


def hub_token() -> str | None:
    """HF_TOKEN, else the token saved by `hf auth login`, else None."""
    if token():
        return token()
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def push_problems(repo_id: str) -> list[str]:
    """What stops a push to `repo_id` before training starts (one line each)."""
    if not repo_id:
        return []
    problems = []
    if not HUB_ID.match(repo_id) or "@" in repo_id:
        problems.append(
            f"config key 'export.push_to_hub': {repo_id!r} is not a Hub repository id (org/name)"
        )
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        return [*problems, "config key 'export.push_to_hub' needs huggingface_hub installed"]
    if hub_token() is None:
        problems.append(
            "config key 'export.push_to_hub' needs a Hugging Face token with write access: set "
            "HF_TOKEN or run `hf auth login`"
        )
    return problems
