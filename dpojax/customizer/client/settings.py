"""`customizer.*` settings: NAT's `nemo_customizer_trainer_adapter` fields plus dpojax's additions.

Field names and meanings mirror NAT 1.9's adapter config (docs/customizer.md#settings) so a NAT
YAML block carries over key for key. Additions: `training_timeout_seconds` (NAT waits forever),
`wait_for_completion` (NAT's trainer field), `cancel_on_interrupt`, `cancel_on_timeout`,
`request_timeout_seconds`, `max_retries`, `retry_backoff_seconds`. NAT's `dataset_output_dir` is
not a key: the Customizer files are always kept in the run's workdir.

The dataclasses below are the one set of defaults: dpojax's config tree takes its `customizer.*`
keys from them (`dpojax.config`), and the local server's dpojax backend fills a job's missing
hyperparameters from them. `CustomizerSettings.from_mapping` validates a plain mapping (or a
ConfigDict) and raises one `SettingsError` listing every bad key as
`customizer.<key>: <problem>`; `settings_problems` returns those lines instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlparse

from dpojax.customizer.client.errors import SettingsError
from dpojax.schema import group, setting

TRAINING_TYPES = ("dpo", "sft")
FINETUNING_TYPES = ("lora", "all_weights")
CANCEL_ON_INTERRUPT = ("ask", "always", "never")
PREFIX = "customizer"


@dataclass(frozen=True)
class DPOParams:
    """The `dpo` block NAT sends (`ref_policy_kl_penalty` is beta)."""

    ref_policy_kl_penalty: float = setting(0.1, "Beta of the DPO loss.")
    preference_loss_weight: float = setting(1.0, "Weight of the preference loss.")
    preference_average_log_probs: bool = setting(
        False, "Average (not sum) the completion log-probs in the preference loss."
    )
    sft_loss_weight: float = setting(0.0, "Weight of the SFT term on the chosen response.")


@dataclass(frozen=True)
class Hyperparameters:
    """The job's `hyperparameters`; all six fields are always sent, as NAT does."""

    training_type: str = setting("dpo", "Customizer training type.", choices=TRAINING_TYPES)
    finetuning_type: str = setting(
        "all_weights", "Full fine-tuning or LoRA adapters.", choices=FINETUNING_TYPES
    )
    epochs: int = setting(3, "Training epochs.")
    batch_size: int = setting(4, "Training batch size.")
    learning_rate: float = setting(5e-5, "Learning rate.")
    dpo: DPOParams = group(DPOParams)

    def to_payload(self) -> dict[str, Any]:
        """The JSON `hyperparameters` object, in NAT's key order."""
        return {
            "training_type": self.training_type,
            "finetuning_type": self.finetuning_type,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "dpo": {
                "ref_policy_kl_penalty": self.dpo.ref_policy_kl_penalty,
                "preference_loss_weight": self.dpo.preference_loss_weight,
                "preference_average_log_probs": self.dpo.preference_average_log_probs,
                "sft_loss_weight": self.dpo.sft_loss_weight,
            },
        }


@dataclass(frozen=True)
class DeploymentConfig:
    """NIM deployment settings used when `deploy_on_completion` is set."""

    image_name: str = setting(
        "nvcr.io/nim/meta/llama-3.1-8b-instruct", "NIM image of the deployment."
    )
    image_tag: str = setting("latest", "Image tag.")
    gpu: int = setting(1, "GPUs of the deployment.")
    deployment_name: str | None = setting(None, "Deployment name; '' (None): derived from the job.")
    description: str = setting("Fine-tuned model deployment", "Deployment description.")


@dataclass(frozen=True)
class CustomizerSettings:
    """Validated `customizer.*` settings (see the module docstring). `hf_token` never prints."""

    entity_host: str = setting(
        "", "URL of the Entity Store, Customizer and Deployment APIs (required)."
    )
    datastore_host: str = setting(
        "", "URL of the Datastore (its HF Hub API is at /v1/hf; required)."
    )
    namespace: str = setting("", "Namespace of the dataset and job (required).")
    customization_config: str = setting(
        "",
        "Customization config of the job, e.g. meta/llama-3.2-1b-instruct@v1.0.0+A100 (required).",
    )
    dataset_name: str = setting("dpojax-dpo", "Name of the uploaded dataset.")
    create_namespace_if_missing: bool = setting(
        True, "Create the namespace in the Entity Store and the Datastore."
    )
    hyperparameters: Hyperparameters = group(Hyperparameters)
    use_full_message_history: bool = setting(
        False, "Send every prompt message (else the last user message), as NAT's option."
    )
    deploy_on_completion: bool = setting(
        False, "Deploy the trained model and wait until it is ready."
    )
    deployment_config: DeploymentConfig = group(DeploymentConfig)
    poll_interval_seconds: float = setting(30.0, "Seconds between status polls.")
    deployment_timeout_seconds: float = setting(
        1800.0, "Longest wait for a deployment to be ready."
    )
    training_timeout_seconds: float = setting(86400.0, "Longest wait for the job to end.")
    max_consecutive_status_failures: int = setting(
        3, "Failed status polls in a row before giving up."
    )
    hf_token: str = dataclasses.field(
        default="",
        repr=False,
        metadata={
            "doc": "Datastore token; '': the HF_TOKEN environment variable. Never printed.",
            "choices": None,
        },
    )
    wait_for_completion: bool = setting(
        True, "Wait for the job to end (else return once it is created)."
    )
    cancel_on_interrupt: str = setting(
        "ask",
        "On Ctrl-C or SIGTERM while waiting: ask, always or never cancel the job.",
        choices=CANCEL_ON_INTERRUPT,
    )
    cancel_on_timeout: bool = setting(
        True, "Cancel the job when training_timeout_seconds runs out."
    )
    request_timeout_seconds: float = setting(60.0, "Timeout of one HTTP request.")
    max_retries: int = setting(3, "Retries of a transient failure (connection, 408, 429, 5xx).")
    retry_backoff_seconds: float = setting(0.5, "First retry delay, doubled each time.")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | Any) -> CustomizerSettings:
        """Validate `values` (a mapping or an object with `to_dict()`); raise `SettingsError`.
        An empty `deployment_config.deployment_name` (the config tree's form of None) is None."""
        settings, problems = _parse(values)
        if problems:
            raise SettingsError("invalid Customizer settings:\n  " + "\n  ".join(problems))
        return settings

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """Plain nested dict of every key; `hf_token` is `"***"` (set) or `""` unless
        `redact=False`."""
        out = _as_dict(self)
        if redact:
            out["hf_token"] = "***" if self.hf_token else ""
        return out


# ----------------------------------------------------------------------------- validation


def _as_dict(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _as_dict(getattr(obj, f.name)) for f in fields(obj)}
    return obj


class _Problems:
    """Collects `customizer.<key>: <problem>` lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, key: str, problem: str) -> None:
        self.lines.append(f"{PREFIX}.{key}: {problem}")


def _to_plain(values: Any) -> Any:
    if hasattr(values, "to_dict") and not isinstance(values, Mapping):
        values = values.to_dict()
    return values


def _check_bool(p: _Problems, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        p.add(key, f"expected true or false, got {value!r}")
    return value


def _check_int(p: _Problems, key: str, value: Any, lo: int | None = None, hi: int | None = None):
    if isinstance(value, bool) or not isinstance(value, int):
        p.add(key, f"expected an integer, got {value!r}")
        return value
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        p.add(key, f"must be {bounds}, got {value}")
    return value


def _check_float(p: _Problems, key: str, value: Any, *, positive: bool) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        p.add(key, f"expected a number, got {value!r}")
        return value
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        p.add(key, f"must be {'> 0' if positive else '>= 0'} and finite, got {value}")
    return float(value)


def _check_str(p: _Problems, key: str, value: Any, *, empty_ok: bool = False) -> Any:
    if not isinstance(value, str):
        p.add(key, f"expected a string, got {value!r}")
    elif not empty_ok and not value.strip():
        p.add(key, "must not be empty")
    return value


def _check_choice(p: _Problems, key: str, value: Any, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        p.add(key, f"must be one of {', '.join(choices)}; got {value!r}")
    return value


def _check_host(p: _Problems, key: str, value: Any) -> Any:
    if not isinstance(value, str) or not value.strip():
        p.add(key, f"expected a URL such as http://host:port, got {value!r}")
        return value
    parsed = urlparse(value.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        p.add(key, f"expected an http:// or https:// URL, got {value!r}")
    return value.strip().rstrip("/")


def _section(p: _Problems, key: str, value: Any, allowed: set[str]) -> dict[str, Any]:
    value = _to_plain(value)
    if not isinstance(value, Mapping):
        p.add(key, f"expected a mapping, got {value!r}")
        return {}
    for name in sorted(set(value) - allowed):
        p.add(f"{key}.{name}", f"unknown key (known: {', '.join(sorted(allowed))})")
    return {k: v for k, v in value.items() if k in allowed}


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _parse_dpo(p: _Problems, raw: Any) -> DPOParams:
    key = "hyperparameters.dpo"
    v = _section(p, key, raw, _names(DPOParams))
    d = DPOParams()
    return DPOParams(
        ref_policy_kl_penalty=_check_float(
            p,
            f"{key}.ref_policy_kl_penalty",
            v.get("ref_policy_kl_penalty", d.ref_policy_kl_penalty),
            positive=False,
        ),
        preference_loss_weight=_check_float(
            p,
            f"{key}.preference_loss_weight",
            v.get("preference_loss_weight", d.preference_loss_weight),
            positive=False,
        ),
        preference_average_log_probs=_check_bool(
            p,
            f"{key}.preference_average_log_probs",
            v.get("preference_average_log_probs", d.preference_average_log_probs),
        ),
        sft_loss_weight=_check_float(
            p, f"{key}.sft_loss_weight", v.get("sft_loss_weight", d.sft_loss_weight), positive=False
        ),
    )


def _parse_hyperparameters(p: _Problems, raw: Any) -> Hyperparameters:
    key = "hyperparameters"
    v = _section(p, key, raw, _names(Hyperparameters))
    d = Hyperparameters()
    return Hyperparameters(
        training_type=_check_choice(
            p, f"{key}.training_type", v.get("training_type", d.training_type), TRAINING_TYPES
        ),
        finetuning_type=_check_choice(
            p,
            f"{key}.finetuning_type",
            v.get("finetuning_type", d.finetuning_type),
            FINETUNING_TYPES,
        ),
        epochs=_check_int(p, f"{key}.epochs", v.get("epochs", d.epochs), lo=1),
        batch_size=_check_int(p, f"{key}.batch_size", v.get("batch_size", d.batch_size), lo=1),
        learning_rate=_check_float(
            p, f"{key}.learning_rate", v.get("learning_rate", d.learning_rate), positive=True
        ),
        dpo=_parse_dpo(p, v.get("dpo", {})),
    )


def _parse_deployment(p: _Problems, raw: Any) -> DeploymentConfig:
    key = "deployment_config"
    v = _section(p, key, raw, _names(DeploymentConfig))
    d = DeploymentConfig()
    name = v.get("deployment_name", d.deployment_name) or None  # "": the config tree's None
    if name is not None:
        _check_str(p, f"{key}.deployment_name", name)
    return DeploymentConfig(
        image_name=_check_str(p, f"{key}.image_name", v.get("image_name", d.image_name)),
        image_tag=_check_str(p, f"{key}.image_tag", v.get("image_tag", d.image_tag)),
        gpu=_check_int(p, f"{key}.gpu", v.get("gpu", d.gpu), lo=1),
        deployment_name=name,
        description=_check_str(
            p, f"{key}.description", v.get("description", d.description), empty_ok=True
        ),
    )


def _check_token(p: _Problems, value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        p.add("hf_token", f"expected a string, got a {type(value).__name__} (value not shown)")
        return ""
    return value


def _required_str(p: _Problems, v: Mapping[str, Any], key: str) -> Any:
    value = v.get(key)
    return "" if value in (None, "") else _check_str(p, key, value)


_REQUIRED = ("entity_host", "datastore_host", "namespace", "customization_config")


def _parse(values: Any) -> tuple[CustomizerSettings | None, list[str]]:
    p = _Problems()
    allowed = _names(CustomizerSettings)
    values = _to_plain(values)
    if not isinstance(values, Mapping):
        raise SettingsError(f"{PREFIX}: expected a mapping of settings, got {values!r}")
    for name in sorted(set(values) - allowed):
        p.add(name, f"unknown key (known: {', '.join(sorted(allowed))})")
    for name in _REQUIRED:
        if values.get(name) in (None, ""):
            p.add(name, "is required")
    v = dict(values)
    d = {f.name: f.default for f in fields(CustomizerSettings) if f.name not in _REQUIRED}
    get = lambda name: v.get(name, d[name])
    kwargs: dict[str, Any] = {
        "entity_host": _check_host(p, "entity_host", v["entity_host"])
        if v.get("entity_host") not in (None, "")
        else "",
        "datastore_host": _check_host(p, "datastore_host", v["datastore_host"])
        if v.get("datastore_host") not in (None, "")
        else "",
        "namespace": _required_str(p, v, "namespace"),
        "customization_config": _required_str(p, v, "customization_config"),
        "dataset_name": _check_str(p, "dataset_name", get("dataset_name")),
        "create_namespace_if_missing": _check_bool(
            p, "create_namespace_if_missing", get("create_namespace_if_missing")
        ),
        "hyperparameters": _parse_hyperparameters(p, v.get("hyperparameters", {})),
        "use_full_message_history": _check_bool(
            p, "use_full_message_history", get("use_full_message_history")
        ),
        "deploy_on_completion": _check_bool(p, "deploy_on_completion", get("deploy_on_completion")),
        "deployment_config": _parse_deployment(p, v.get("deployment_config", {})),
        "max_consecutive_status_failures": _check_int(
            p, "max_consecutive_status_failures", get("max_consecutive_status_failures"), 1, 10
        ),
        "hf_token": _check_token(p, get("hf_token")),
        "wait_for_completion": _check_bool(p, "wait_for_completion", get("wait_for_completion")),
        "cancel_on_interrupt": _check_choice(
            p, "cancel_on_interrupt", get("cancel_on_interrupt"), CANCEL_ON_INTERRUPT
        ),
        "cancel_on_timeout": _check_bool(p, "cancel_on_timeout", get("cancel_on_timeout")),
        "max_retries": _check_int(p, "max_retries", get("max_retries"), 0, 10),
    }
    for name in (
        "poll_interval_seconds",
        "deployment_timeout_seconds",
        "training_timeout_seconds",
        "request_timeout_seconds",
    ):
        kwargs[name] = _check_float(p, name, get(name), positive=True)
    kwargs["retry_backoff_seconds"] = _check_float(
        p, "retry_backoff_seconds", get("retry_backoff_seconds"), positive=False
    )
    return (None if p.lines else CustomizerSettings(**kwargs)), p.lines


def settings_problems(values: Mapping[str, Any] | Any) -> list[str]:
    """Every problem of `values`, one `customizer.<key>: <problem>` line each."""
    return _parse(values)[1]
