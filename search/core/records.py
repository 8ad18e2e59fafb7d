"""The plain values every stage hands on for one trial: its state and, once measured, its record."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from search.core.knob_registry import SHORT_LABELS, UNLABELLED

__all__ = [
    "COMPLETE",
    "FAILED",
    "FAULT_KINDS",
    "INFEASIBLE",
    "SCREENED",
    "TrialRecord",
    "config_name",
    "fault_kind",
    "si",
    "value_text",
    "with_requests",
]

COMPLETE, FAILED, INFEASIBLE = "complete", "failed", "infeasible"
"""A trial's state: measured; a fault (see ``FAULT_KINDS``); never run or not a valid
configuration."""
SCREENED = "screened"
"""A measurement's stop reason when racing stopped it early (``search.analysis.racing``): the
figures stay, with the wider interval of fewer windows."""
FAULT_KINDS = ("oom", "crash", "timeout", "error")
"""What a failed trial's ``failure`` starts with (``oom: ...``)."""


def fault_kind(failure: str) -> str:
    """The kind of a failure line: one of ``FAULT_KINDS``, or '' for anything else."""
    kind = failure.split(":", 1)[0]
    return kind if kind in FAULT_KINDS else ""


@dataclass(kw_only=True, frozen=True)
class TrialRecord:
    """One measured configuration, as the study, the report and the tracker see it."""

    number: int
    """The Optuna trial number."""
    config: Mapping[str, Any]
    """Knob values under their space names."""
    state: str
    """``COMPLETE``, ``FAILED`` or ``INFEASIBLE``."""
    metrics: Mapping[str, float]
    """Measured figures, units in their names (see ``search.execution.figures.trial_metrics``);
    empty unless complete."""
    stable: bool
    failure: str = ""
    """One line: why the trial failed or is infeasible."""
    run_id: str | None = None
    """The MLflow child run."""
    unit: str = "items"
    """What one item of throughput is (throughput is in ``unit``/s)."""
    time_s: float = 0.0
    """When the trial's measurement ended, s since the epoch (0.0: unknown)."""
    reason: str = ""
    """Why it is not stable: the test it failed, with its figures ('' when stable)."""
    why: str = ""
    """Why it was proposed, in a few words (``search.strategy.guided``; '' when not known)."""

    @property
    def screened(self) -> bool:
        """Whether racing stopped its measurement early, out of reach of the front
        (``search.analysis.racing``): its interval is that of fewer windows."""
        return self.metrics.get("screened", 0.0) == 1.0


def config_name(config: Mapping[str, Any]) -> str:
    """A configuration in a few characters, as MLflow's runs list shows it: ``bs32·mb8·bf16·s2``.

    Generic sizes abbreviated (``bs``, ``mb``, ``s``), a string value alone (``bf16``), a true
    flag by its name (``recompute``) and a false one left out, a knob at its plain value left
    out where the registry says so (``compile`` off), any other value as ``name=value``.
    """
    parts = []
    for name, value in config.items():
        if isinstance(value, bool):
            if value:
                parts.append(name)
        elif name in UNLABELLED and value == UNLABELLED[name]:
            continue
        elif name in SHORT_LABELS:
            parts.append(f"{SHORT_LABELS[name]}{value}")
        elif isinstance(value, str):
            parts.append(value)
        else:
            parts.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}")
    return "·".join(parts) or "default"


def with_requests(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` with requests/s derived from the throughput figures as they stand (after the
    noise floor widened or corrected them): a serving trial's ``requests_per_s`` (and its
    ``_ci_low``, ``_ci_high``) is its throughput over the items of one request
    (``items_per_request``); other trials are returned as they are."""
    per_request = metrics.get("items_per_request")
    if not per_request:
        return dict(metrics)
    return {
        **metrics,
        **{
            f"requests_per_s{end}": metrics[f"throughput{end}"] / per_request
            for end in ("", "_ci_low", "_ci_high")
            if f"throughput{end}" in metrics
        },
    }


def si(value: float) -> str:
    """``value`` with an SI prefix and 3 significant digits: ``41.2k``, ``989T``."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def value_text(value: Any) -> str:
    """A knob's value as the terminal shows it (a float to 4 significant figures)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
