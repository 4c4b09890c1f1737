"""Typed requests of the local Customizer server (pydantic models, so FastAPI validates every
body and path parameter and publishes them in the server's OpenAPI schema).

The rules (docs/customizer.md#request-validation): names that become path components (namespaces,
repos, datasets, deployments, file paths in a repo) use a safe alphabet (`SAFE_NAME`), so nothing
can point outside `--root`; numbers are finite and within bounds; types are strict (no `"3"` for
3, no `true` for 1); unknown fields are accepted only where the real service's clients send more
than the server reads, and they can only hold JSON values (non-finite numbers, deep nesting and
oversized bodies are refused before routing, `dpojax.customizer_server.guard`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# One part of a file path inside a repo: the safe alphabet; "." and ".." are refused separately.
SAFE_PATH_PART = r"^[A-Za-z0-9._@+=-]{1,255}$"
SAFE_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
REPO_TYPES_PLURAL = r"^(models|datasets|spaces)$"
MAX_TEXT = 4096
MAX_PATH = 1024

SafeName = Annotated[str, StringConstraints(pattern=SAFE_NAME)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
NonEmptyText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT)]
RepoPath = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH)]
StrictInt = Annotated[int, Field(strict=True)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
StrictBool = Annotated[bool, Field(strict=True)]

# Path parameters (Annotated: FastAPI gives each parameter its own copy).
NamePath = Annotated[str, Path(pattern=SAFE_NAME)]
IdPath = Annotated[str, Path(pattern=SAFE_ID)]
RepoTypePath = Annotated[str, Path(pattern=REPO_TYPES_PLURAL)]


class _Body(BaseModel):
    """A request body: unknown fields kept (JSON values only), numbers finite."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _extras_serialise(self) -> _Body:
        """Unknown fields are stored and served back: they must serialise as strict JSON (the
        guard refuses non-finite numbers in JSON bodies; this holds for any body that parsed)."""
        try:
            json.dumps(self.model_extra or {}, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"unknown fields must hold finite JSON values ({e})") from None
        return self


class _Closed(BaseModel):
    """A request body with only the fields it declares."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# --------------------------------------------------------------------- Entity Store


class NamespaceIn(_Body):
    id: SafeName
    description: Text | None = None


class DatasetIn(_Body):
    name: SafeName
    namespace: SafeName | None = None
    files_url: NonEmptyText
    description: Text | None = None


# --------------------------------------------------------------------- Customizer


class DPOParamsIn(_Body):
    ref_policy_kl_penalty: Annotated[FiniteFloat, Field(ge=0, le=1e6)] = 0.1
    preference_loss_weight: Annotated[FiniteFloat, Field(ge=0, le=1e6)] = 1.0
    preference_average_log_probs: StrictBool = False
    sft_loss_weight: Annotated[FiniteFloat, Field(ge=0, le=1e6)] = 0.0


class LoraParamsIn(_Body):
    adapter_dim: Annotated[StrictInt, Field(ge=1, le=4096)] = 16
    alpha: Annotated[FiniteFloat, Field(gt=0, le=1e6)] | None = None
    adapter_dropout: Annotated[FiniteFloat, Field(ge=0, le=1)] | None = None


class HyperparametersIn(_Body):
    finetuning_type: Literal["lora", "lora_merged", "all_weights"]
    training_type: Literal["sft", "dpo", "distillation", "grpo"] = "sft"
    epochs: Annotated[StrictInt, Field(ge=1, le=10_000)] = 3
    batch_size: Annotated[StrictInt, Field(ge=1, le=65_536)] = 4
    learning_rate: Annotated[FiniteFloat, Field(gt=0, le=10)] = 5e-5
    max_seq_length: Annotated[StrictInt, Field(ge=2, le=1_048_576)] | None = None
    dpo: DPOParamsIn | None = None
    lora: LoraParamsIn | None = None


class ConfigRef(_Body):
    name: NonEmptyText


class DatasetRef(_Body):
    name: SafeName
    namespace: SafeName | None = None


DatasetRefText = Annotated[
    str,
    StringConstraints(
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
    ),
]


class JobIn(_Body):
    config: NonEmptyText | ConfigRef
    dataset: DatasetRefText | DatasetRef
    hyperparameters: HyperparametersIn
    namespace: SafeName | None = None
    output_model: NonEmptyText | None = None
    description: Text | None = None


# --------------------------------------------------------------------- Deployments


class DeploymentConfigIn(_Body):
    name: SafeName
    namespace: SafeName | None = None
    description: Text | None = None
    model: Text | None = None


class ModelDeploymentIn(_Body):
    name: SafeName
    namespace: SafeName | None = None
    description: Text | None = None
    config: Text | None = None
    models: Annotated[list[Text], Field(max_length=100)] | None = None


# --------------------------------------------------------------------- Datastore (HF Hub)

RepoName = Annotated[
    str,
    StringConstraints(
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
    ),
]


class RepoCreateIn(_Body):
    name: RepoName
    organization: SafeName | None = None
    type: Literal["model", "dataset", "space"] | None = None
    private: StrictBool | None = None


class PreuploadFile(_Body):
    path: RepoPath
    size: Annotated[StrictInt, Field(ge=0)] | None = None
    sample: Annotated[str, StringConstraints(max_length=4096)] | None = None


class PreuploadIn(_Body):
    files: Annotated[list[PreuploadFile], Field(max_length=1000)] = []


class CommitHeader(_Closed):
    summary: Text = ""
    description: Text | None = None
    parentCommit: Text | None = None  # noqa: N815 - the Hub's field name


class CommitFile(_Closed):
    path: RepoPath
    content: str = ""
    encoding: Literal["base64", "utf-8"] | None = None


class CommitDeletion(_Closed):
    path: RepoPath


class CommitLine(_Closed):
    """One line of a commit's NDJSON body."""

    key: Literal["header", "file", "deletedFile", "deletedFolder"]
    value: dict[str, Any]


# The request body of a commit, described for the OpenAPI schema (FastAPI cannot read NDJSON).
COMMIT_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-ndjson": {
                "schema": {"type": "string", "description": "one CommitLine JSON per line"}
            }
        },
    }
}
NAMESPACE_FORM_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-www-form-urlencoded": {
                "schema": {
                    "type": "object",
                    "properties": {"namespace": {"type": "string", "pattern": SAFE_NAME}},
                    "required": ["namespace"],
                }
            }
        },
    }
}


# --------------------------------------------------------------------- admin (tests only)


class SeedDeploymentsIn(_Closed):
    count: Annotated[StrictInt, Field(ge=0, le=10_000)] = 1
    namespace: SafeName | None = None
    prefix: SafeName = "filler"
    status: Text | None = None
