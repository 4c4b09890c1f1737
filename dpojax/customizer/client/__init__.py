"""The NeMo Customizer client: `submit(pairs, settings, workdir=...)` runs NAT's adapter flow
with the real `nemo-microservices` SDK and `huggingface_hub` (optional extra `customizer`), with
NAT's known faults fixed (docs/customizer.md).

Modules: `submission` (the flow), `service` (the REST calls), `transport` (retries and error
classes), `settings` (the `customizer.*` keys and their defaults), `status` (job status mapping),
`errors` (exceptions and exit codes), `auth` (tokens and redaction), `artifacts` (run files).
"""

from dpojax.customizer.client.auth import Redactor, plain_http_warning, resolve_hf_token
from dpojax.customizer.client.errors import (
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
from dpojax.customizer.client.settings import (
    CustomizerSettings,
    DeploymentConfig,
    DPOParams,
    Hyperparameters,
)
from dpojax.customizer.client.status import JobStatus, map_status
from dpojax.customizer.client.submission import SubmitResult, submit

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
