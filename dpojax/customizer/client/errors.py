"""Customizer failures: one exception type and one process exit code per kind of outcome.

| exception | exit code | meaning |
|---|---|---|
| `SettingsError` | 2 | a `customizer.*` key is wrong (nothing was sent) |
| `JobFailedError` | 3 | the service ran the job and the job failed |
| `ServiceUnreachableError` | 4 | the service could not be reached (connection, timeouts, 5xx) |
| `RequestRejectedError` | 5 | the service answered, but refused a request (4xx) |
| `JobCancelledError` | 6 | the job was cancelled on the server |
| `TrainingTimeoutError` | 7 | `training_timeout_seconds` ran out before the job ended |
| `DeploymentError` | 8 | the model trained, but its deployment failed or never became ready |
| `SubmitInterrupted` | 130 | Ctrl-C or SIGTERM while waiting (job cancelled, or told how to) |
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_SETTINGS = 2
EXIT_JOB_FAILED = 3
EXIT_SERVICE_UNREACHABLE = 4
EXIT_REQUEST_REJECTED = 5
EXIT_JOB_CANCELLED = 6
EXIT_TRAINING_TIMEOUT = 7
EXIT_DEPLOYMENT_FAILED = 8
EXIT_INTERRUPTED = 130


class CustomizerError(Exception):
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
