"""The connection to an MLflow tracking server: network limits, checks of its address, and telling
an outage (unreachable, timed out, 5xx) from bad input."""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

import mlflow.environment_variables
import requests
from mlflow.utils.uri import is_local_uri

from search.config.compose import redact

__all__ = [
    "NETWORK_LIMITS",
    "innermost_cause",
    "check_http_uri",
    "is_http",
    "is_local",
    "limit_network",
    "unreachable",
]

NETWORK_LIMITS = {
    # MLflow's defaults (120 s timeout, 7 retries with backoff factor 2) wait about 4 minutes before
    # reporting an unreachable server. These are read on every request (mlflow/utils/rest_utils.py),
    # so setting them before the first one is enough; a value the user set is kept.
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    # On a server, MLflow prints a "View run ... at: URL" line to stdout each time a run ends:
    # one per trial, in the middle of the trial lines. The tool prints the link to the front.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def limit_network() -> None:
    """Apply ``NETWORK_LIMITS`` to this process's MLflow HTTP requests (and its printing of run
    links), keeping any the user set."""
    for name, value in NETWORK_LIMITS.items():
        os.environ.setdefault(name, value)


def is_local(uri: str) -> bool:
    """Whether ``uri`` names a store on this machine (a file or a database), not a server."""
    return not uri.startswith(("http://", "https://", "databricks"))


def file_store_refusal(uri: str) -> str | None:
    """Why ``uri`` is refused where MLflow would open it as its file store (a path or ``file:``,
    by MLflow's own test; not ``sqlite:`` or ``databricks``), which MLflow 3 refuses with a page
    on migrating it, not the fix here; None where the user opted back in, or where MLflow is one
    that opens it."""
    allowed = getattr(mlflow.environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if allowed is None or allowed.get():
        return None
    try:
        local = is_local_uri(uri, is_tracking_or_registry_uri=True)
    except Exception:  # noqa: BLE001 - a URI MLflow cannot read (a remote file:) is its to refuse
        return None
    if not local:
        return None
    return (
        f"tracking.uri {uri!r} names a folder, MLflow's file store, which MLflow 3 refuses "
        "(unless MLFLOW_ALLOW_FILE_STORE=true); give a database, e.g. "
        "tracking.uri=sqlite:///runs/mlflow.db, or a server, http://HOST:5000"
    )


def is_http(uri: str) -> bool:
    """Whether ``uri`` names a tracking server reached over HTTP(S)."""
    return uri.startswith(("http://", "https://"))


def check_http_uri(uri: str) -> None:
    """A malformed server address is bad input, not an unreachable server."""
    try:
        parts = urlsplit(uri)
        _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        raise ValueError(f"malformed tracking URI {redact(uri)!r}: {e}") from None
    if not parts.hostname:
        raise ValueError(f"tracking URI {redact(uri)!r} names no host: use http://HOST:PORT")


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, outermost first."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def unreachable(error: BaseException) -> bool:
    """True when ``error`` says the server could not be reached or could not serve: connection
    refused, DNS failure, timeout, or 5xx responses after MLflow's retries.

    MLflow wraps the ``requests`` error in a plain ``MlflowException``, so the chain is searched.
    A certificate failure (SSLError) is configuration, not an outage, and is not counted.
    """
    for e in _chain(error):
        if isinstance(e, requests.exceptions.SSLError):
            return False
        if isinstance(
            e,
            (
                requests.exceptions.ConnectionError,
                requests.exceptions.Timeout,
                requests.exceptions.RetryError,
            ),
        ):
            return True
    return bool(re.search(r"failed with error code 5\d\d\b", str(error)))


def innermost_cause(error: BaseException) -> str:
    """The innermost reason, on one line
    (``ConnectionRefusedError: [Errno 111] Connection refused``)."""
    innermost = _chain(error)[-1]
    text = str(innermost).strip().splitlines()[0] if str(innermost).strip() else ""
    text = re.sub(r"^<[^>]*>: ", "", text)  # urllib3 prefixes the connection object
    return f"{type(innermost).__name__}: {text}" if text else type(innermost).__name__
