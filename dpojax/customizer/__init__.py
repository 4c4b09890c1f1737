"""NeMo Customizer: a submission client and a local API-compatible server.

Client: `submit(pairs, settings, workdir=...)` runs NAT's adapter flow with the real
`nemo-microservices` SDK and `huggingface_hub` (optional extra `customizer`), with NAT's known
faults fixed. Server: `python -m dpojax.customizer.server` (see `server`).
"""

from dpojax.customizer.client import SubmitResult, submit
from dpojax.customizer.errors import (
    EXIT_DEPLOYMENT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_REQUEST_REJECTED,
    EXIT_SERVICE_UNREACHABLE,
    EXIT_SETTINGS,
    EXIT_TRAINING_TIMEOUT,
    CustomizerError,
    DeploymentError,
    JobCancelledError,
    JobFailedError,
    MissingDependencyError,
    RequestRejectedError,
    ServiceUnreachableError,
    SettingsError,
    SubmitInterrupted,
    TrainingTimeoutError,
)
from dpojax.customizer.settings import (
    CustomizerSettings,
    DeploymentConfig,
    DPOParams,
    Hyperparameters,
)
from dpojax.customizer.status import JobStatus, map_status
from dpojax.customizer.tokens import Redactor, plain_http_warning, resolve_hf_token

__all__ = [
    "EXIT_DEPLOYMENT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_JOB_CANCELLED",
    "EXIT_JOB_FAILED",
    "EXIT_OK",
    "EXIT_REQUEST_REJECTED",
    "EXIT_SERVICE_UNREACHABLE",
    "EXIT_SETTINGS",
    "EXIT_TRAINING_TIMEOUT",
    "CustomizerError",
    "CustomizerSettings",
    "DPOParams",
    "DeploymentConfig",
    "DeploymentError",
    "Hyperparameters",
    "JobCancelledError",
    "JobFailedError",
    "JobStatus",
    "MissingDependencyError",
    "Redactor",
    "RequestRejectedError",
    "ServiceUnreachableError",
    "SettingsError",
    "SubmitInterrupted",
    "SubmitResult",
    "TrainingTimeoutError",
    "map_status",
    "plain_http_warning",
    "resolve_hf_token",
    "submit",
]
