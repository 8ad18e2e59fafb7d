"""The package's errors, under one root: ``except SearchError`` catches any of them.

Each also derives from the built-in its callers have caught so far (``ValueError`` for bad input,
``RuntimeError`` for a store that keeps failing), so code written against those still works.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "KnobError",
    "SearchError",
    "SpaceError",
    "StoreError",
    "WorkloadContractError",
    "first_line",
    "require",
]


class SearchError(Exception):
    """Any error this package raises on purpose, with a message that says what to do."""


class ConfigError(SearchError, ValueError):
    """Bad input on the command line or in a config file; the message says what to change."""


class SpaceError(SearchError, ValueError):
    """A space file that cannot be used as written; the message says what to change."""


class KnobError(SearchError, ValueError):
    """A knob value this workload or device cannot run."""


class WorkloadContractError(SearchError, TypeError):
    """A workload that breaks its contract in a trial (its loss returned no tensor, say): a fault
    of the workload that no configuration mends, so the study stops at the first trial that shows
    it (``search.study.outcome.workload_fault``)."""


class StoreError(SearchError, RuntimeError):
    """A write to the study failed on every attempt (one line: what, why, where the measurement
    is kept and how to recover it)."""


def require(holds: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``holds``: a settings check in one line.

    A plain ValueError: settings are built in code as well as from a config file, and
    ``search.config.compose`` turns it into a ``ConfigError`` where a config file is read.
    """
    if not holds:
        raise ValueError(message)


def first_line(error: BaseException) -> str:
    """The first line of what ``error`` says (its type's name where it says nothing): a library's
    error inside a one-line refusal."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
