"""What a study keeps of the runs repeated on configurations measured before: the control runs that
measure the machine's noise, the re-validations of candidates, the second processes of compiled
trials, and the noise floor judged from them (the policy that judges them is
``search.stability.leave_one_out``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
from optuna.trial import TrialState

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.core.records import COMPLETE
from search.revalidation.pooling import Pooled, Run
from search.stability.judge import DISPERSED
from search.stability.leave_one_out import judged_candidates
from search.storage.machine_runs import machine_sessions
from search.storage.retried_writes import retried

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "CONTROL_PREFIX",
    "REVALIDATED_PREFIX",
    "REVALIDATION_RUN_PREFIX",
    "judged_revalidations",
    "noise_floor",
    "save_control",
    "save_revalidation",
    "save_revalidation_run",
    "study_controls",
    "study_revalidations",
    "trial_pairs",
    "unfinished_revalidations",
]

REVALIDATED_PREFIX = "revalidated:"
"""Study user attr ``revalidated:<fingerprint>:<trial number>``: a candidate's pooled figures."""
REVALIDATION_RUN_PREFIX = "revalidation_run:"
"""Study user attr ``revalidation_run:<fingerprint>:<trial number>:<time>``: one re-validation
run, kept as it ends, so that an interrupted re-validation resumes with the runs it had."""
CONTROL_PREFIX = "control:"
"""Study user attr ``control:<fingerprint>:<time>:<owner>``: one control run's figures."""


def save_control(study: optuna.Study, fingerprint: str, run: RunFigures, who: str) -> None:
    """Keep one control run's figures in the study."""
    retried(
        lambda: study.set_user_attr(
            f"{CONTROL_PREFIX}{fingerprint}:{run.time_s:.3f}:{who}", run.as_dict()
        ),
        "store a control run in the study",
    )


def study_controls(study: optuna.Study, fingerprint: str) -> list[RunFigures]:
    """The control runs of ``fingerprint``, oldest first."""
    prefix = f"{CONTROL_PREFIX}{fingerprint}:"
    runs = [RunFigures.from_dict(v) for k, v in study.user_attrs.items() if k.startswith(prefix)]
    return sorted(runs, key=lambda r: r.time_s)


def noise_floor(study: optuna.Study, fingerprint: str, settings: Settings) -> NoiseFloor:
    """The machine's noise floor from the study's control runs and re-validation replicates."""
    return _judged(study, fingerprint, settings)[0]


def _judged(
    study: optuna.Study, fingerprint: str, settings: Settings
) -> tuple[NoiseFloor, dict[int, Pooled]]:
    """The noise floor and the re-validated candidates judged against it, by the leave-one-out
    policy (``search.stability.leave_one_out``) on what the study keeps and on the other studies'
    control runs on this machine (``search.storage.machine_runs``)."""
    controls = study_controls(study, fingerprint)
    earlier = machine_sessions(Path(settings.runs_dir), controls)
    return judged_candidates(
        controls,
        trial_pairs(study, fingerprint),
        study_revalidations(study, fingerprint),
        settings,
        [(s.same_control, s.runs) for s in earlier],
    )


def trial_pairs(study: optuna.Study, fingerprint: str) -> list[tuple[RunFigures, RunFigures]]:
    """The two fresh processes of each compiled trial of ``fingerprint``
    (``search.stability.measured.again_if_compiled``), both complete: groups of the floor's
    between-run variance as a re-validated candidate's runs are. They are the configurations' own
    spread between processes, where the control and its probe only stand in for it, and they cost
    no run of their own. A trial that reused another's measurement is left out (the same pair),
    and so is one measured again for its window dispersion (``again_if_dispersed``): chosen for a
    first run that a burst may have moved, its pair would overstate the spread."""
    pairs = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        attrs = trial.user_attrs
        second = attrs.get("second_process")
        if attrs.get("fingerprint") != fingerprint or "reused_from" in attrs:
            continue
        if not second or second.get("state") != COMPLETE or "measured_at" not in attrs:
            continue
        if second.get("why") == DISPERSED:
            continue
        device = str(attrs.get("measured_on", ""))
        first = RunFigures.of(attrs["metrics"], float(attrs["measured_at"]))
        again = RunFigures.of(second["metrics"], float(second["time_s"]))
        pairs.append((replace(first, device=device), replace(again, device=device)))
    return pairs


def save_revalidation(study: optuna.Study, fingerprint: str, number: int, pooled: Pooled) -> None:
    """Keep a candidate's re-validated figures in the study."""
    figures = {
        "metrics": dict(pooled.metrics),
        "stable": pooled.stable,
        "reason": pooled.reason,
        "runs": [r.as_dict() for r in pooled.runs],
    }
    retried(
        lambda: study.set_user_attr(f"{REVALIDATED_PREFIX}{fingerprint}:{number}", figures),
        f"store the re-validation of trial #{number} in the study",
    )


def save_revalidation_run(study: optuna.Study, fingerprint: str, number: int, run: Run) -> None:
    """Keep one re-validation run of trial ``number`` in the study as soon as it ends."""
    retried(
        lambda: study.set_user_attr(
            f"{REVALIDATION_RUN_PREFIX}{fingerprint}:{number}:{run.time_s:.6f}", run.as_dict()
        ),
        f"store a re-validation run of trial #{number} in the study",
    )


def unfinished_revalidations(study: optuna.Study, fingerprint: str) -> dict[int, list[Run]]:
    """The runs of re-validations that were interrupted (kept run by run, never pooled), by trial
    number, oldest first."""
    prefix = f"{REVALIDATION_RUN_PREFIX}{fingerprint}:"
    pooled = study_revalidations(study, fingerprint)
    runs: dict[int, list[Run]] = {}
    for key, value in study.user_attrs.items():
        if key.startswith(prefix):
            number = int(key[len(prefix) :].split(":")[0])
            if number not in pooled:
                runs.setdefault(number, []).append(Run.from_dict(value))
    return {n: sorted(r, key=lambda run: run.time_s) for n, r in runs.items()}


def study_revalidations(study: optuna.Study, fingerprint: str) -> dict[int, Pooled]:
    """Re-validated figures of ``fingerprint``'s trials as stored, by trial number. One stored by
    a version before the noise floor (without its runs) counts as not re-validated: its verdict
    was of another kind, and it is measured again."""
    prefix = f"{REVALIDATED_PREFIX}{fingerprint}:"
    return {
        int(key[len(prefix) :]): Pooled(
            v["metrics"],
            v["stable"],
            v["reason"],
            tuple(RunFigures.from_dict(r) for r in v.get("runs", ())),
        )
        for key, v in study.user_attrs.items()
        if key.startswith(prefix) and "runs" in v
    }


def judged_revalidations(
    study: optuna.Study, fingerprint: str, settings: Settings
) -> dict[int, Pooled]:
    """Re-validated figures with the throughput interval of the mean of the fresh runs and the
    verdict judged now (see ``_judged``); a failed or throttled candidate keeps its stored
    verdict."""
    return _judged(study, fingerprint, settings)[1]
