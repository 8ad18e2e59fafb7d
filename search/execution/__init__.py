"""Running one trial in its worker process: the request and the result (``trial``), each trial in
a fresh process (``isolation``, ``worker``, ``_fork_server``), the generic knobs (``knobs`` and a
module per lever), serving (``serving``), the fidelity check (``fidelity``), a trial's figures as
plain numbers (``figures``). Nothing of Optuna or MLflow.

Exported lazily (``search.core.lazy_exports``): ``isolation`` imports Hydra and the fork server's
modules, which the packages that read a trial's figures (``figures``) or a knob's rules do not
need, and the worker process imports only the modules it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.execution.figures import trial_metrics
    from search.execution.fp8 import FP8_PRECISIONS
    from search.execution.isolation import run_isolated
    from search.execution.knobs import unsupported_reason, value_rule
    from search.execution.recompute import RECOMPUTE_NONE, named_by, recompute_setting
    from search.execution.trial import TrialRequest, TrialResult

__all__ = [
    "FP8_PRECISIONS",
    "RECOMPUTE_NONE",
    "TrialRequest",
    "TrialResult",
    "named_by",
    "recompute_setting",
    "run_isolated",
    "trial_metrics",
    "unsupported_reason",
    "value_rule",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "figures": ["trial_metrics"],
        "fp8": ["FP8_PRECISIONS"],
        "isolation": ["run_isolated"],
        "knobs": ["unsupported_reason", "value_rule"],
        "recompute": ["RECOMPUTE_NONE", "named_by", "recompute_setting"],
        "trial": ["TrialRequest", "TrialResult"],
    },
)
