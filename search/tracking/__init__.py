"""MLflow: an experiment per space, a parent run per invocation, a child run per trial
(``tracker``); the server's limits and telling an outage from bad input (``connection``).

Exported lazily (``search.core.lazy_exports``): ``tracker`` imports MLflow, which ``connection``
does without."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.tracking.tracker import Tracker, quoted

__all__ = ["Tracker", "quoted"]

__getattr__ = lazy_exports(
    __name__,
    {
        "tracker": ["Tracker", "quoted"],
    },
)
