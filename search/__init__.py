"""search: find the best stable settings for a PyTorch workload on the hardware in front of it.

Exported lazily (``search.core.lazy_exports``): ``python -m search`` runs this file before the
command line, which starts the trials' fork server before it imports torch itself
(``search.commands.cli``); a workload's ``from search import Workload`` imports it as before."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.core.errors import SearchError
    from search.workloads.base import ServingWorkload, Workload

__all__ = ["SearchError", "ServingWorkload", "Workload"]

__getattr__ = lazy_exports(
    __name__, {"core.errors": ["SearchError"], "workloads.base": ["ServingWorkload", "Workload"]}
)
