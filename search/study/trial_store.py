"""The trial store: what a study keeps of each trial in Optuna, and reading it back as records.

A trial's figures live in its user attributes (Optuna's values hold only what it ranks on):

- ``config``: the knob values; ``fingerprint``: workload, device and torch it was measured under;
- ``state`` (``COMPLETE``, ``FAILED``, ``INFEASIBLE``) and ``failure`` (one line);
- ``metrics``: every figure (``search.execution.figures.trial_metrics``); ``unit``: what throughput
counts;
- ``memory_limit_mb``, ``stderr_tail`` (faults), ``owner`` (see liveness); ``mlflow_run_id`` on
  trials of older versions, which logged to MLflow before telling Optuna;
- ``measured_at``: when its measurement ended (s since the epoch; the noise floor's clock);
- ``reused_from``: the trial whose outcome a repeated proposal was told again.

A trial cannot change once told, so what is learned later is kept on the study: the MLflow run of a
trial, logged after it was told, by the run or by ``sync`` (``mlflow_run:<number>``), re-validated
figures (``revalidated:<fingerprint>:<number>``), and the control runs that measure the machine's
noise (``control:<fingerprint>:...``). Optuna is used here, by ``search.study.driver`` and by
``search.study.liveness``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from search.analysis.noise_floor import NoiseFloor, RunFigures, assess, assess_pooled
from search.config.compose import redact
from search.core.errors import StoreError
from search.core.records import COMPLETE, FAILED, TrialRecord
from search.space.search_space import SearchSpace
from search.study.revalidate import Pooled, Run

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = [
    "CONTROL_PREFIX",
    "OUTCOME_ATTRS",
    "REVALIDATED_PREFIX",
    "REVALIDATION_RUN_PREFIX",
    "SYNCED_RUN_PREFIX",
    "UNSAVED",
    "WRITE_ATTEMPTS",
    "judged_revalidations",
    "keep_unsaved",
    "named_constraints",
    "noise_floor",
    "over_limit",
    "own_trials",
    "record_of",
    "record_synced_run",
    "restore_unsaved",
    "retried",
    "save_control",
    "save_revalidation",
    "save_revalidation_run",
    "set_aside",
    "set_constraints",
    "store_measured",
    "study_controls",
    "study_history",
    "study_revalidations",
    "tell_failed",
    "unfinished_revalidations",
]

T = TypeVar("T")

SYNCED_RUN_PREFIX = "mlflow_run:"
"""Study user attr ``mlflow_run:<trial number>``: the MLflow run of a trial (logged after it was
told)."""
REVALIDATED_PREFIX = "revalidated:"
"""Study user attr ``revalidated:<fingerprint>:<trial number>``: a candidate's pooled figures."""
REVALIDATION_RUN_PREFIX = "revalidation_run:"
"""Study user attr ``revalidation_run:<fingerprint>:<trial number>:<time>``: one re-validation
run, kept as it ends, so that an interrupted re-validation resumes with the runs it had."""
CONTROL_PREFIX = "control:"
"""Study user attr ``control:<fingerprint>:<time>:<owner>``: one control run's figures."""
OUTCOME_ATTRS = ("config", "fingerprint", "state", "failure", "metrics", "unit", "measured_on")
"""What a repeated proposal copies from the trial whose outcome it is told again."""


WRITE_ATTEMPTS = 6
"""Attempts at one write to the study before it is given up (waits of 0.5, 1, 2, 4, 8 s between:
over 15 s, three times sqlite's own wait for a lock)."""
UNSAVED = "unsaved.jsonl"
"""In ``runs_dir``: measurements the study could not take (one JSON object a line), for ``sync``
to add to the study."""


def retried(write: Callable[[], T], what: str) -> T:
    """``write()``, tried again with back-off while the storage fails (a locked sqlite file, a
    full disk, a dropped database connection); ``StoreError`` after the last attempt. Refusals of
    the write itself (a finished trial, a bad value) are raised at once."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            return write()
        except (optuna.exceptions.StorageInternalError, OSError) as e:
            if attempt == WRITE_ATTEMPTS - 1:
                cause = str(e.__cause__ or e).strip().splitlines()
                raise StoreError(
                    f"cannot {what} after {WRITE_ATTEMPTS} attempts: {type(e).__name__}"
                    + (f": {redact(cause[0])}" if cause else "")
                ) from e
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def keep_unsaved(
    runs_dir: Path, study: optuna.Study, number: int, attrs: Mapping[str, Any], values: Any
) -> Path | None:
    """Append a measurement the study could not take to ``runs_dir/unsaved.jsonl``; its path, or
    None when that cannot be written either (then the line goes to stderr)."""
    try:
        study_id = study.user_attrs.get("study_id")
    except Exception:  # the storage that just failed may fail this read too
        study_id = None
    line = json.dumps(
        {
            "study": study.study_name,
            "study_id": study_id,
            "trial": number,
            "user_attrs": dict(attrs),
            "values": None if values is None else [float(v) for v in values],
        },
        default=str,
    )
    path = runs_dir / UNSAVED
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(line + "\n")
        return path
    except OSError:
        print(f"search: unsaved measurement: {line}", file=sys.stderr)
        return None


def store_measured(
    trial: Trial,
    record: TrialRecord,
    values: Sequence[float | None],
    *,
    fingerprint: str,
    memory_limit_mb: float | None,
    stderr_tail: str = "",
    stored_metrics: Mapping[str, float] | None = None,
    runs_dir: Path | None = None,
    constraints: Mapping[str, float] | None = None,
) -> FrozenTrial:
    """Keep a measured trial's record in its user attrs and tell it: COMPLETE with ``values`` and
    ``constraints`` (``pareto.constraint_values``), else FAIL. ``stored_metrics``: the run's own
    figures, kept instead of the record's (which may span runs or be corrected for drift:
    ``search.analysis.noise_floor.assess`` derives those again when read).

    Writes are retried while the storage fails (``retried``); when every attempt fails, the
    measurement goes to ``runs_dir/unsaved.jsonl`` (``sync`` adds it to the study) and
    ``StoreError`` says so."""
    attrs = {
        "config": dict(record.config),
        "fingerprint": fingerprint,
        "state": record.state,
        "failure": record.failure,
        "metrics": dict(record.metrics if stored_metrics is None else stored_metrics),
        "unit": record.unit,
        "memory_limit_mb": memory_limit_mb,
        "measured_at": record.time_s,
    }
    if record.state == FAILED and stderr_tail:
        attrs["stderr_tail"] = stderr_tail[-4000:]
    told = [float(v) for v in values if v is not None] if record.state == COMPLETE else None

    def write() -> FrozenTrial:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if told is not None:
            set_constraints(trial, constraints or {})
            return trial.study.tell(trial, told)
        return trial.study.tell(trial, state=TrialState.FAIL)

    try:
        return retried(write, f"store trial #{record.number} in the study")
    except StoreError as e:
        kept = keep_unsaved(runs_dir or Path("."), trial.study, record.number, attrs, told)
        where = f"is kept in {kept}" if kept else "is printed above (unsaved measurement)"
        raise StoreError(
            f"{e}. Its measurement {where}: when the storage works again, run "
            "`python -m search sync` with the same arguments to add it to the study"
        ) from e


def named_constraints(trial: FrozenTrial) -> dict[str, float]:
    """The constraints ``set_constraints`` told ``trial``, by name (without the list form)."""
    prefix = "constraints:"
    return {k[len(prefix) :]: v for k, v in trial.system_attrs.items() if k.startswith(prefix)}


def set_constraints(trial: Trial, constraints: Mapping[str, float]) -> None:
    """``trial.set_constraint`` for each of ``constraints`` not set yet (a retried write sets
    them again; Optuna keeps the first value and warns), and the same values as one list under
    ``constraints``, Optuna's earlier form, which optuna-dashboard reads (0.21 reads no other) to
    draw infeasible trials apart. Optuna reads both forms; the values agree."""
    storage = trial.study._storage
    have = storage.get_trial_system_attrs(trial._trial_id)
    for name, value in constraints.items():
        if f"constraints:{name}" not in have:
            trial.set_constraint(name, value)
    if constraints and "constraints" not in have:
        storage.set_trial_system_attr(
            trial._trial_id, "constraints", [float(v) for v in constraints.values()]
        )


def restore_unsaved(
    study: optuna.Study, runs_dir: Path, distributions: Mapping[str, tuple[str, Any]]
) -> list[int]:
    """Add the measurements of this study kept in ``runs_dir/unsaved.jsonl`` (see
    ``store_measured``) to the study as new trials; the numbers they had. Lines of other studies
    stay in the file; one already in the study (the write had gone through after all) is not added
    twice. ``distributions``: each searched knob's Optuna name and distribution, so that the
    sampler learns from a restored trial whose configuration still fits them."""
    path = runs_dir / UNSAVED
    if not path.exists():
        return []
    ours = {study.study_name}
    kept, restored = [], []

    def key(attrs: Mapping[str, Any]) -> tuple[str, Any, Any]:
        config = json.dumps(attrs.get("config"), sort_keys=True)
        return config, attrs.get("measured_at"), attrs.get("state")

    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    present = {key(t.user_attrs) for t in finished}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("study") not in ours or entry.get("study_id") not in (
            None,
            study.user_attrs.get("study_id"),
        ):
            kept.append(line)
            continue
        attrs, values = entry["user_attrs"], entry["values"]
        if key(attrs) not in present:
            study.add_trial(_restored_trial(attrs, values, distributions))
            present.add(key(attrs))
        restored.append(int(entry["trial"]))
    if kept:
        path.write_text("".join(f"{line}\n" for line in kept))
    else:
        path.unlink()
    return restored


def _restored_trial(
    attrs: Mapping[str, Any], values: Sequence[float] | None, distributions: Mapping[str, Any]
) -> FrozenTrial:
    config = attrs.get("config", {})
    params = {name: config[knob] for knob, (name, _) in distributions.items() if knob in config}
    dists = {name: dist for knob, (name, dist) in distributions.items() if knob in config}
    fits = len(params) == len(distributions) and all(
        dists[n]._contains(dists[n].to_internal_repr(v)) for n, v in params.items()
    )
    return optuna.trial.create_trial(
        params=params if fits else None,
        distributions=dists if fits else None,
        values=values,
        state=TrialState.COMPLETE if values is not None else TrialState.FAIL,
        user_attrs={**attrs, "restored_from": "unsaved.jsonl"},
    )


def tell_failed(trial: Trial, why: str) -> None:
    """Tell ``trial`` FAIL with ``why`` unless it was told already (the loop's last resort)."""
    try:
        trial.set_user_attr("state", FAILED)
        trial.set_user_attr("failure", redact(why.splitlines()[0]))
        trial.study.tell(trial, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass  # it was told before the error came
    except (optuna.exceptions.StorageInternalError, OSError):
        pass  # the storage is failing: left RUNNING, recovered as stale by the next process


def own_trials(study: optuna.Study, fingerprint: str, space: SearchSpace) -> list[FrozenTrial]:
    """Finished measured trials that belong to ``fingerprint`` and still lie in ``space``."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    return [
        t
        for t in trials
        if t.user_attrs.get("fingerprint") == fingerprint
        and "metrics" in t.user_attrs
        and space.contains(t.user_attrs["config"])
    ]


def set_aside(study: optuna.Study, fingerprint: str) -> dict[str, int]:
    """Measured trials of other fingerprints (another workload source, device or torch), counted
    by fingerprint: they stay in the study but are not reused or put on the front."""
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
        theirs = t.user_attrs.get("fingerprint")
        if theirs and theirs != fingerprint and "metrics" in t.user_attrs:
            if "reused_from" not in t.user_attrs:
                counts[theirs] = counts.get(theirs, 0) + 1
    return counts


def _time_s(trial: FrozenTrial) -> float:
    """When the trial's measurement ended: stored as ``measured_at``; for a trial stored before
    that, when it was told."""
    if "measured_at" in trial.user_attrs:
        return float(trial.user_attrs["measured_at"])
    end = trial.datetime_complete or trial.datetime_start
    return end.timestamp() if end is not None else 0.0


def over_limit(attrs: Mapping[str, Any], memory_limit_mb: float | None) -> str:
    """Why a complete trial counts as out of memory under ``memory_limit_mb``, a limit tighter
    than the one it was measured under (its peak lies above it); '' when it does not."""
    peak = attrs.get("metrics", {}).get("peak_memory_mb")
    if attrs.get("state") != COMPLETE or memory_limit_mb is None or peak is None:
        return ""
    if peak <= memory_limit_mb:
        return ""
    return (
        f"oom: peak memory {peak:.0f} MB is above runner.memory_limit_mb = {memory_limit_mb:g} MB "
        "(measured under a looser limit)"
    )


def record_of(
    trial: FrozenTrial, floor: NoiseFloor, settings: Settings, synced: Mapping[str, Any]
) -> TrialRecord:
    """The record of a stored trial: its interval spanning runs and its stability judged now,
    against ``floor``, from the stored figures (``search.analysis.noise_floor.assess``)."""
    attrs = trial.user_attrs
    metrics, stable, reason, time_s = attrs["metrics"], False, "", _time_s(trial)
    state, failure = attrs["state"], attrs.get("failure", "")
    over = over_limit(attrs, settings.runner.memory_limit_mb)
    if over:
        state, failure = FAILED, over
    elif state == COMPLETE:
        metrics, verdict = assess(
            metrics,
            time_s,
            floor,
            settings.stable,
            settings.measure.confidence,
            str(attrs.get("measured_on", "")),
        )
        stable, reason = verdict.stable, verdict.reason
    return TrialRecord(
        trial.number,
        attrs["config"],
        state,
        metrics,
        stable,
        failure,
        attrs.get("mlflow_run_id") or synced.get(f"{SYNCED_RUN_PREFIX}{trial.number}"),
        attrs.get("unit", "items"),
        time_s,
        reason,
    )


def study_history(
    study: optuna.Study,
    fingerprint: str,
    space: SearchSpace,
    settings: Settings,
    floor: NoiseFloor | None = None,
) -> list[TrialRecord]:
    """Every measured (not reused) trial of ``fingerprint`` within ``space``, oldest first, judged
    against ``floor`` (by default the study's: ``noise_floor``).

    ``run_id`` is the MLflow child run, from the trial or, for a trial logged later by ``sync``,
    from the study.
    """
    synced = study.user_attrs
    floor = floor or noise_floor(study, fingerprint, settings)
    return [
        record_of(t, floor, settings, synced)
        for t in own_trials(study, fingerprint, space)
        if "reused_from" not in t.user_attrs
    ]


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
    """The noise floor and the re-validated candidates judged against it.

    Each candidate is judged against a floor without its own runs, so that an erratic candidate
    cannot set its own yardstick; the floor that figures are reported with holds only the
    replicates of candidates judged stable (a throttled or erratic one says nothing about the
    machine).
    """
    controls = study_controls(study, fingerprint)
    stored = study_revalidations(study, fingerprint)
    groups = {n: p.runs for n, p in stored.items() if p.stable and len(p.runs) >= 2}
    confidence = settings.measure.confidence
    verdicts = {}
    for number, runs in groups.items():
        others = NoiseFloor.estimate(controls, [g for m, g in groups.items() if m != number])
        verdicts[number] = assess_pooled(
            stored[number].metrics, runs, others, settings.stable, confidence
        )[1]
    floor = NoiseFloor.estimate(controls, [g for n, g in groups.items() if verdicts[n].stable])
    judged = {}
    for number, pooled in stored.items():
        if number not in verdicts:
            judged[number] = pooled  # failed or throttled: its stored verdict stands
            continue
        metrics, _ = assess_pooled(pooled.metrics, pooled.runs, floor, settings.stable, confidence)
        verdict = verdicts[number]
        judged[number] = Pooled(metrics, verdict.stable, verdict.reason, pooled.runs)
    return floor, judged


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


def record_synced_run(study: optuna.Study, number: int, run_id: str) -> bool:
    """Remember the MLflow run of trial ``number``, logged after the trial was told (a told trial
    cannot change). Best effort: False when the storage would not take it. The measurement is in
    the study already, and ``sync`` finds the run by its tags and records it then."""
    try:
        retried(
            lambda: study.set_user_attr(f"{SYNCED_RUN_PREFIX}{number}", run_id),
            f"store the MLflow run of trial #{number} in the study",
        )
    except StoreError:
        return False
    return True
