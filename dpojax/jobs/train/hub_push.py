"""Push the exported model to the Hugging Face Hub (`export.push_to_hub = "org/name"`).

After a completed training run, `WORKDIR/export/` (the model, with LoRA the merged model plus the
PEFT adapter in `adapter/`) gets a model card (`README.md`: base model, data, recipe, final
metrics; huggingface_hub's ModelCard) and is uploaded with `huggingface_hub`: the repository is
created if needed (private unless `export.private=False`), then the folder is committed in one
commit. Transient failures (HTTP 429 and 5xx, dropped connections) are retried with exponential
back-off here: the client retries its file transfers (preupload, LFS and Xet uploads) but not the
repository creation nor the commit request itself (huggingface_hub 1.3 to 2.4). A missing token is
refused before any compute (`push_problems`), and HF_ENDPOINT points the upload at another Hub.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from dpojax.errors import EXIT_PUSH, DpojaxError
from dpojax.jobs.train.report import metric_rows
from dpojax.models.hub import (  # push_problems: re-exported for the config checks' callers
    HUB_ID,
    endpoint,
    hub_token,
    push_problems,  # noqa: F401
)

log = logging.getLogger(__name__)

T = TypeVar("T")
CARD_FILE = "README.md"


class PushError(DpojaxError, RuntimeError):
    """The push to the Hub failed; the run and its export are complete."""

    exit_code = EXIT_PUSH


def _transient(exc: Exception) -> bool:
    """HTTP 429 / 5xx and connection failures are worth another try; 4xx are not."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        return status == 429 or status >= 500
    return (
        isinstance(exc, ConnectionError | TimeoutError | OSError) or "Connect" in type(exc).__name__
    )


def with_retries(call: Callable[[], T], *, what: str, tries: int = 4, wait: float = 1.0) -> T:
    """`call()`, tried up to `tries` times on transient errors (`wait`, 2 * wait, ... seconds
    apart); other errors and the last failure raise `PushError`."""
    for attempt in range(1, tries + 1):
        try:
            return call()
        except Exception as exc:  # huggingface_hub raises many types; sorted below
            if attempt == tries or not _transient(exc):
                raise PushError(f"{what} failed ({type(exc).__name__}: {exc})") from exc
            log.warning("%s failed (%s); retrying in %.0f s", what, exc, wait)
            time.sleep(wait)
            wait *= 2
    raise AssertionError("unreachable")


def _metrics_table(metrics: Mapping[str, float] | None) -> list[str]:
    if not metrics:
        return ["(no evaluation ran)"]
    lines = ["| metric | value | meaning |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {meaning} |" for name, value, meaning in metric_rows(metrics)]
    return lines


def card_metadata(config) -> Any:
    """The model card's metadata (huggingface_hub's ModelCardData): library, pipeline, tags, and
    the base model and dataset where they are Hub ids."""
    from huggingface_hub import ModelCardData

    m, d = config.model, config.data
    return ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["dpo", "dpojax"],
        base_model=m.path.split("@")[0] if HUB_ID.match(m.path) else None,
        datasets=[d.train_path.split("@")[0]] if HUB_ID.match(d.train_path) else None,
    )


def model_card(
    config, summary: Mapping[str, Any], *, pairs: int | None, repo_id: str, title: str = ""
) -> str:
    """The README.md of an exported or pushed model (a huggingface_hub ModelCard): metadata and
    what the run did. `repo_id` is what `from_pretrained` loads it from (the Hub repository, or
    the export folder); `title` defaults to its last part; `pairs` None: not known (an export
    that read no data)."""
    from huggingface_hub import ModelCard

    m, d, loss, optim, train = config.model, config.data, config.loss, config.optim, config.train
    lora = f"LoRA rank {config.lora.rank}, alpha {config.lora.alpha}" if config.lora.rank else ""
    split = f" (split {d.train_split})" if d.train_split else ""
    count = f", {pairs} preference pairs" if pairs is not None else ""
    body = [
        f"# {title or repo_id.rstrip('/').split('/')[-1]}",
        "",
        f"Trained with dpojax by Direct Preference Optimization from `{m.path}`.",
        "",
        "## Training",
        "",
        f"- data: `{d.train_path}`{split}{count}",
        f"- loss: {loss.type}, beta {loss.beta}; {optim.name}, learning rate "
        f"{optim.learning_rate} ({optim.schedule})",
        f"- {summary.get('step', 0)} steps of {train.batch_size} pairs, max length "
        f"{d.max_length} tokens" + (f"; {lora}" if lora else ""),
        f"- reference: {config.reference.type}",
        "",
        "## Final evaluation",
        "",
        *_metrics_table(summary.get("final_eval")),
        "",
        "## Use",
        "",
        *_use(config, repo_id),
    ]
    card = ModelCard(f"---\n{card_metadata(config).to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
    return str(card)


def _use(config, repo_id: str) -> list[str]:
    """How to load the export: the merged model (its adapter in `adapter/`), or with
    `export.merged=False` the adapter alone, on its base model through PEFT."""
    if config.lora.rank and not config.export.merged:
        return [
            f"A LoRA adapter in PEFT's format for `{config.model.path}` (the base model, not in "
            "this folder):",
            "",
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
            "```",
        ]
    lines = [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        "```",
    ]
    if config.lora.rank:
        lines += ["", "The LoRA adapter alone (PEFT format) is in `adapter/`."]
    return lines


def write_card(folder: Path, card: str) -> Path:
    """`card` as `folder`/README.md (every export has one, pushed or not)."""
    path = Path(folder) / CARD_FILE
    path.write_text(card)
    return path


def push_to_hub(
    folder: Path,
    repo_id: str,
    *,
    card: str,
    private: bool = True,
    tries: int = 4,
    wait: float = 1.0,
) -> dict[str, str]:
    """Writes `card` as `folder/README.md` and uploads `folder` to the model repository `repo_id`
    (created if needed); returns {"repo", "url", "commit"}."""
    from huggingface_hub import HfApi

    access = hub_token()
    if access is None:
        raise PushError(
            "pushing to the Hub needs a token with write access: set HF_TOKEN or run "
            "`hf auth login`"
        )
    write_card(folder, card)
    api = HfApi(endpoint=endpoint(), token=access)
    url = with_retries(
        lambda: api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model"),
        what=f"creating the Hub repository {repo_id}",
        tries=tries,
        wait=wait,
    )
    commit = with_retries(
        lambda: api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload a model trained with dpojax",
        ),
        what=f"uploading {folder} to {repo_id}",
        tries=tries,
        wait=wait,
    )
    out = {"repo": repo_id, "url": str(url), "commit": str(getattr(commit, "oid", ""))}
    log.info("pushed %s to %s", folder, json.dumps(out))
    return out
