"""The Python API: ``search.tune`` and ``search.retune`` (``search.api.tuning``), exported from
``search`` itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.api.tuning import RetuneResult, TuneResult, retune, tune

__all__ = ["RetuneResult", "TuneResult", "retune", "tune"]

__getattr__ = lazy_exports(__name__, {"tuning": ["RetuneResult", "TuneResult", "retune", "tune"]})
