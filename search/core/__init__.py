"""The plain values every layer shares: the errors, under one root (``errors``), a trial's state
and record (``records``), the metrics, which end of each is ranked on and how each is pooled
(``metrics``), and the registry of generic knobs (``knob_registry``).

Exported lazily (``lazy_exports``): every ``import search`` runs this file, since the package's
own ``__init__`` imports the errors, and ``metrics`` imports SciPy, which ``python -m search
--help`` and a workload's own module have no use for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.core.errors import (
        ConfigError,
        KnobError,
        SearchError,
        SpaceError,
        StoreError,
        require,
    )
    from search.core.knob_registry import GENERIC_KNOBS, NUMERIC_KNOBS, knob_names
    from search.core.metrics import (
        MAXIMIZE,
        METRICS,
        POOL_MAX,
        POOL_MEAN_UPPER,
        POOL_PROCESS_MEANS,
        POOL_STEPS,
        Metric,
        directions,
        latency_quantiles,
        objective_values,
        quantile_lower_bound,
        quantile_upper_bound,
        ranked_on,
    )
    from search.core.records import (
        COMPLETE,
        FAILED,
        FAULT_KINDS,
        INFEASIBLE,
        SCREENED,
        TrialRecord,
        config_name,
        fault_kind,
        si,
        with_requests,
    )

__all__ = [
    "COMPLETE",
    "FAILED",
    "FAULT_KINDS",
    "GENERIC_KNOBS",
    "INFEASIBLE",
    "MAXIMIZE",
    "METRICS",
    "NUMERIC_KNOBS",
    "POOL_MAX",
    "POOL_MEAN_UPPER",
    "POOL_PROCESS_MEANS",
    "POOL_STEPS",
    "SCREENED",
    "ConfigError",
    "KnobError",
    "Metric",
    "SearchError",
    "SpaceError",
    "StoreError",
    "TrialRecord",
    "config_name",
    "directions",
    "fault_kind",
    "knob_names",
    "latency_quantiles",
    "objective_values",
    "quantile_lower_bound",
    "quantile_upper_bound",
    "ranked_on",
    "require",
    "si",
    "with_requests",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "errors": [
            "ConfigError",
            "KnobError",
            "SearchError",
            "SpaceError",
            "StoreError",
            "require",
        ],
        "knob_registry": ["GENERIC_KNOBS", "NUMERIC_KNOBS", "knob_names"],
        "metrics": [
            "MAXIMIZE",
            "METRICS",
            "POOL_MAX",
            "POOL_MEAN_UPPER",
            "POOL_PROCESS_MEANS",
            "POOL_STEPS",
            "Metric",
            "directions",
            "latency_quantiles",
            "objective_values",
            "quantile_lower_bound",
            "quantile_upper_bound",
            "ranked_on",
        ],
        "records": [
            "COMPLETE",
            "FAILED",
            "FAULT_KINDS",
            "INFEASIBLE",
            "SCREENED",
            "TrialRecord",
            "config_name",
            "fault_kind",
            "si",
            "with_requests",
        ],
    },
)
