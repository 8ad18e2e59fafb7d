"""The tuned record kept in the Optuna study: what one tuning or re-tune concluded, and the
baseline a re-tune finds among them.

Every tuning and re-tune keeps what it concluded in the study (``Tuned``), so that the next
re-tune finds its baseline there even when MLflow is down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import optuna

from search.core.errors import ConfigError
from search.retuning.comparison import MIN_RUNS
from search.retuning.figure import Figure
from search.storage.retried_writes import retried

__all__ = [
    "RETUNE",
    "TUNE",
    "TUNED_PREFIX",
    "Tuned",
    "baseline",
    "comparable",
    "save_tuned",
    "tuned_runs",
]

TUNED_PREFIX = "tuned:"
"""Study user attr ``tuned:<time>``: what one tuning or re-tune concluded (``Tuned``)."""
TUNE, RETUNE = "tune", "retune"


@dataclass(frozen=True, kw_only=True)
class Tuned:
    """What one tuning or re-tune concluded: the baseline of the next re-tune."""

    kind: str
    """``tune`` or ``retune``."""
    name: str
    """``<kind> <YYYY-mm-dd HH:MM:SS>``, as ``history`` lists it and ``retune.baseline`` names
    it."""
    time_s: float
    fingerprint: str
    """The workload fingerprint (model source and settings, device, torch)."""
    env: dict[str, str]
    device: str
    unit: str
    recommended: Figure | None
    """The recommendation as its confirmation runs measured it (``confirm``): the figure
    re-tunes compare with."""
    front: tuple[Figure, ...] = ()
    mlflow_run_id: str | None = None
    verdict: str = ""
    """A re-tune's overall verdict (``regression``, ``moved``, ...); '' for a tuning."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tuned:
        def figure(f: Mapping[str, Any] | None) -> Figure | None:
            if f is None:
                return None
            return Figure(
                **{
                    **f,
                    "runs": tuple(f.get("runs", ())),
                    "references": tuple(f.get("references", ())),
                }
            )

        known = {f.name for f in fields(cls)}
        return cls(
            **{
                **{k: v for k, v in d.items() if k in known},
                "recommended": figure(d.get("recommended")),
                "front": tuple(figure(f) for f in d.get("front", ())),
            }
        )


def save_tuned(study: optuna.Study, tuned: Tuned) -> None:
    retried(
        lambda: study.set_user_attr(f"{TUNED_PREFIX}{tuned.time_s:.3f}", tuned.as_dict()),
        "store the run's conclusion in the study",
    )


def tuned_runs(study: optuna.Study) -> list[Tuned]:
    """Every tuning and re-tune of the study, oldest first."""
    runs = [Tuned.from_dict(v) for k, v in study.user_attrs.items() if k.startswith(TUNED_PREFIX)]
    return sorted(runs, key=lambda t: t.time_s)


def comparable(t: Tuned) -> bool:
    """Whether a re-tune can compare with ``t``: its recommendation was confirmed in fresh runs."""
    return t.recommended is not None and len(t.recommended.runs) >= MIN_RUNS


def baseline(study: optuna.Study, which: str, device: str) -> Tuned:
    """The run a re-tune compares with: the last one on ``device`` whose recommendation was
    confirmed, or the one named ``which``; ``ConfigError`` when there is none."""
    on_device = [t for t in tuned_runs(study) if t.device == device]
    runs = [t for t in on_device if comparable(t)]
    if which != "last":
        named = [t for t in runs if t.name == which]
        if not named:
            raise ConfigError(
                f"retune.baseline={which!r} names no run of study '{study.study_name}' on "
                f"{device} with a confirmed recommendation; runs: "
                f"{', '.join(t.name for t in runs) or 'none'} (python -m search history lists "
                "them)"
            )
        return named[-1]
    if not runs:
        unconfirmed = [t for t in on_device if t.recommended is not None]
        raise ConfigError(
            f"study '{study.study_name}' has no tuning on {device} with a confirmed "
            "recommendation to compare with: run the tuning first (python -m search with the "
            "same arguments" + (f", and retune.confirm >= {MIN_RUNS}" if unconfirmed else "") + ")"
        )
    return runs[-1]
