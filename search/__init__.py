"""search: find the best stable settings for a PyTorch workload on the hardware in front of it.

Exported lazily (``search.core.lazy_exports``): ``python -m search`` runs this file before the
command line, which starts the trials' fork server before it imports torch itself
(``search.commands.cli``); a workload's ``from search import Workload`` imports it as before."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.api.tuning import RetuneResult, TuneResult, retune, tune
    from search.core.errors import SearchError
    from search.workloads.base import ServingWorkload, Workload

__all__ = [
    "RetuneResult",
    "SearchError",
    "ServingWorkload",
    "TuneResult",
    "Workload",
    "retune",
    "tune",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "api.tuning": ["RetuneResult", "TuneResult", "retune", "tune"],
        "core.errors": ["SearchError"],
        "workloads.base": ["ServingWorkload", "Workload"],
    },
)
