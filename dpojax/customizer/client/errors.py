"""Customizer failures: one exception type and one process exit code per kind of outcome.

The codes are those of every mode (`dpojax.errors.EXITS`); the submission's own outcomes have
codes of their own (earlier builds of 0.1.0 used 3-8, which meant other things in the other modes).

| exception | exit code | meaning |
|---|---|---|
| `SettingsError` | 2 | a `customizer.*` key is wrong (nothing was sent) |
| `JobFailedError` | 10 | the service ran the job and the job failed |
| `ServiceUnreachableError` | 11 | the service could not be reached (connection, timeouts, 5xx) |
| `RequestRejectedError` | 12 | the service answered, but refused a request (4xx) |
| `JobCancelledError` | 13 | the job was cancelled on the server |
| `TrainingTimeoutError` | 14 | `training_timeout_seconds` ran out before the job ended |
| `DeploymentError` | 15 | the model trained, but its deployment failed or never became ready |
| `SubmitInterrupted` | 130 | Ctrl-C or SIGTERM while waiting (job cancelled, or told how to) |
"""

from __future__ import annotations

from typing import Any

from dpojax import errors as codes
from dpojax.errors import DpojaxError

# The client's names for the codes of `dpojax.errors.EXITS`.
EXIT_OK = codes.EXIT_OK
EXIT_INTERRUPTED = codes.EXIT_INTERRUPTED
EXIT_SETTINGS = codes.EXIT_CONFIG
EXIT_JOB_FAILED = codes.EXIT_SUBMIT_JOB_FAILED
EXIT_SERVICE_UNREACHABLE = codes.EXIT_SUBMIT_UNREACHABLE
EXIT_REQUEST_REJECTED = codes.EXIT_SUBMIT_REJECTED
EXIT_JOB_CANCELLED = codes.EXIT_SUBMIT_CANCELLED
EXIT_TRAINING_TIMEOUT = codes.EXIT_SUBMIT_TIMEOUT
EXIT_DEPLOYMENT_FAILED = codes.EXIT_SUBMIT_DEPLOYMENT


class CustomizerError(DpojaxError):
    """Base of every Customizer failure; `exit_code` is what a CLI should exit with.

    `result` holds the (partial) `SubmitResult` when the failure happened after a job existed.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, result: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.result = result


class SettingsError(CustomizerError, ValueError):
    """Invalid `customizer.*` settings; the message names every bad key."""

    exit_code = EXIT_SETTINGS


class ServiceUnreachableError(CustomizerError):
    """The service could not be reached (connection refused or reset, timeouts, 5xx) after the
    bounded retries."""

    exit_code = EXIT_SERVICE_UNREACHABLE


class RequestRejectedError(CustomizerError):
    """The service answered a request with an error that retrying cannot fix (a 4xx)."""

    exit_code = EXIT_REQUEST_REJECTED

    def __init__(self, message: str, *, status_code: int | None = None, result: Any = None):
        super().__init__(message, result=result)
        self.status_code = status_code


class JobFailedError(CustomizerError):
    """The customization job ended in `failed`; the message carries the server's reason."""

    exit_code = EXIT_JOB_FAILED


class JobCancelledError(CustomizerError):
    """The customization job ended in `cancelled` (cancelled on the server, not by us)."""

    exit_code = EXIT_JOB_CANCELLED


class TrainingTimeoutError(CustomizerError):
    """`training_timeout_seconds` elapsed before the job reached a terminal state."""

    exit_code = EXIT_TRAINING_TIMEOUT


class DeploymentError(CustomizerError):
    """Deployment failed, or did not become ready within `deployment_timeout_seconds`."""

    exit_code = EXIT_DEPLOYMENT_FAILED


class SubmitInterrupted(CustomizerError):
    """Ctrl-C or SIGTERM while waiting on the job."""

    exit_code = EXIT_INTERRUPTED


class MissingDependencyError(CustomizerError, ImportError):
    """The optional `customizer` extra is not installed."""

    exit_code = EXIT_SETTINGS


def require_extra(module: str) -> Any:
    """Import `module` or raise `MissingDependencyError` naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{module} is needed for the Customizer client/server: pip install 'dpojax[customizer]'"
            f" ({exc})"
        ) from None
