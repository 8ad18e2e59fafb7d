"""One invocation: validate everything, open the stores, run the study, report.

All validation happens before anything is written (``search.config.compose``,
``search.config.prepare``), and a store that cannot be opened removes what this invocation created
in ``runs_dir`` (``search.storage.stores``), so bad input leaves nothing behind. Once the parent run
has started it is always ended: FINISHED, KILLED (Ctrl-C) or FAILED.

The steps are siblings of this module: ``context`` (what every step reads), ``callbacks`` (the
study driver), ``retune`` (a re-tune's start), ``revalidation_rounds`` and ``finish`` (the end of
the study) and ``conclusion`` (the confirmation and this run's record).
"""

from __future__ import annotations

import importlib.metadata
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
import yaml
from omegaconf import DictConfig
from rich.console import Console

from search.commands.callbacks import study_driver
from search.commands.conclusion import conclude_tuning
from search.commands.context import Context, Spent
from search.commands.finish import finish
from search.commands.invocation import command_line
from search.commands.retune import adopt_remeasured, remeasure_baseline, warm_start
from search.config.compose import (
    ConfigError,
    for_logging,
    load_settings,
    redact,
    redact_tree,
)
from search.config.prepare import fingerprint, prepare
from search.config.settings import Settings
from search.execution.isolation import wait_for_worker_server
from search.measurement.energy import energy_unavailable_reason
from search.measurement.environment import contention, environment
from search.measurement.host_load import CpuMark, cpu_mark
from search.measurement.peak import MEASURE_FAILURES, PEAKS_FILE, Peak, device_peak
from search.reporting.report import console, si
from search.retuning.comparison import MIN_RUNS
from search.retuning.tuned import Tuned, baseline
from search.revalidation.pooling import Pooled
from search.space.search_space import SearchSpace
from search.storage.liveness import Heartbeat, Recovery, owner
from search.storage.optuna_private import study_storage
from search.storage.stores import open_stores, quiet_libraries, recover_runs, require_study
from search.storage.trial_store import set_aside
from search.tracking.tracker import Tracker

__all__ = ["Ran", "retuning", "run_retune", "run_tune", "tuning"]


@dataclass(frozen=True)
class Ran:
    """What an invocation left: its exit code, and where to read what it found."""

    code: int
    parent_run_id: str | None
    """The invocation's MLflow parent run (None where MLflow could not be reached)."""
    study_dir: Path
    """``runs_dir/<study.name>``: ``best.yaml``, ``pareto.csv``, ``summary.md``."""


def run_tune(cfg_node: DictConfig) -> int:
    """A tuning: the study searched, re-validated and concluded; the exit code."""
    return tuning(cfg_node).code


def run_retune(cfg_node: DictConfig) -> int:
    """A re-tune (``retuning``); the exit code."""
    return retuning(cfg_node).code


def tuning(cfg_node: DictConfig) -> Ran:
    """A tuning: the study searched, re-validated and concluded."""
    checked = _checked(cfg_node)
    study = checked.settings.study
    if study.n_trials == 0:  # a summary of what workers stored: a study must exist
        require_study(study.name, study.storage)
    return _invocation(checked, _opened(checked), None)


def retuning(cfg_node: DictConfig) -> Ran:
    """A re-tune against the study's last tuning (or ``retune.baseline``): the baseline's front
    re-measured, a little search, and today's recommendation confirmed and compared. It needs
    confirmation runs and its baseline's study."""
    checked = _checked(cfg_node)
    settings = checked.settings
    if settings.retune.confirm == 0:
        raise ConfigError(
            "retune.confirm=0: a re-tune compares confirmation runs of today's "
            f"recommendation with the baseline's; use retune.confirm >= {MIN_RUNS}"
        )
    require_study(settings.study.name, settings.study.storage)
    opened = _opened(checked)
    device_name = environment(checked.device)["device_name"]
    base = baseline(opened.study, settings.retune.baseline, device_name)
    return _invocation(checked, opened, base)


@dataclass(frozen=True)
class _Checked:
    """What an invocation read and checked before it writes anything."""

    cfg_node: DictConfig
    spent: Spent
    settings: Settings
    device: torch.device
    space: SearchSpace
    notes: list[str]
    control: dict[str, Any] | None
    out: Console


@dataclass(frozen=True)
class _Opened:
    """The stores an invocation opened, and who recovers what stopped processes left."""

    study: optuna.Study
    tracker: Tracker
    recovery: Recovery
    cpu_since: CpuMark | None
    """The CPU's accounting when the stores began to open: how busy others keep it since."""


def _checked(cfg_node: DictConfig) -> _Checked:
    """The settings, the device and the space, validated before anything is written."""
    spent = Spent()
    quiet_libraries()
    settings = load_settings(cfg_node)
    ready = prepare(settings)
    return _Checked(
        cfg_node, spent, settings, ready.device, ready.space, ready.notes, ready.control, console()
    )


def _opened(checked: _Checked) -> _Opened:
    """The space's notes said, and the study and the tracker opened."""
    for note in checked.notes:
        checked.out.print(f"[yellow]note:[/] {note}")
    cpu_since = cpu_mark()
    recovery = Recovery(checked.settings.study.heartbeat_s)
    study, tracker = open_stores(checked.settings, checked.space, recovery)
    return _Opened(study, tracker, recovery, cpu_since)


def _invocation(checked: _Checked, opened: _Opened, base: Tuned | None) -> Ran:
    """The parent run started and the study run under it (a re-tune of ``base`` where given)."""
    out, device, settings, tracker = checked.out, checked.device, checked.settings, opened.tracker
    if tracker.offline_reason:
        out.print(
            f"warning: {tracker.offline_reason}; going on without MLflow: results stay in the "
            "Optuna study, and `python -m search sync` with the same arguments copies them later",
            markup=False,
        )
    env = {**environment(device), **_versions()}
    peak = _peak(out, device, env["device_name"], checked.space, Path(settings.runs_dir))
    ctx = Context(
        settings=settings,
        space=checked.space,
        device=device,
        env=env,
        fingerprint=fingerprint(checked.space, env),
        out=out,
        control=checked.control,
        peaks=[peak],
        spent=checked.spent,
    )
    cfg = for_logging(checked.cfg_node)  # as written, for the parent run's params and config.yaml
    _start_parent(ctx, tracker, cfg, base, contention(device, opened.cpu_since))
    code = _run_study(ctx, opened.study, tracker, opened.recovery, base, cfg)
    return Ran(code, tracker.parent_id, ctx.study_dir())


def _run_study(
    ctx: Context,
    study: optuna.Study,
    tracker: Tracker,
    recovery: Recovery,
    base: Tuned | None,
    cfg: Mapping[str, Any],
) -> int:
    """The study (a re-tune of ``base`` where given) under the started parent run, which it always
    ends: FINISHED, KILLED (Ctrl-C) or FAILED; the exit code."""
    out = ctx.out
    status = "FAILED"
    heartbeat = Heartbeat(
        recovery.heartbeat_s,
        study_storage(study),
        lambda tags: tracker.set_tags(tracker.parent_id, tags),
    )
    stage = START
    try:
        _recover(ctx, study, tracker, recovery)
        tracker.log_text(yaml.safe_dump(redact_tree(cfg), sort_keys=False), "config.yaml")
        _set_aside(ctx, study)
        remeasured: dict[str, Pooled] = {}
        if base is not None:
            stage = BASELINE
            remeasured = remeasure_baseline(ctx, study, base)
            ctx, stage = warm_start(ctx, study, base), START
        driver = study_driver(ctx, study, tracker, recovery, heartbeat)
        for note in driver.notes:
            out.print(f"note: {note}", markup=False)
        stage = SEARCH
        outcome = driver.run()
        stage = AFTER_SEARCH
        _peak_again(ctx)
        if remeasured:
            adopt_remeasured(ctx, driver, remeasured)
        finished = finish(ctx, driver, outcome, tracker)
        ctx.spent.took(driver)
        code = conclude_tuning(ctx, study, tracker, base, finished)
        if outcome.failure_stop:
            print(f"search: error: stopped early: {outcome.failure_stop}", file=sys.stderr)
            return 1
        status = "FINISHED"
        return code
    except KeyboardInterrupt:
        status = "KILLED"
        out.print(f"[red]interrupted[/] {_interrupted(stage, base is not None)}")
        return 130
    finally:
        heartbeat.close()
        tracker.end_parent(status)


START, SEARCH, BASELINE, AFTER_SEARCH = "start", "search", "baseline", "after the search"
"""Where an invocation is when Ctrl-C stops it: what is kept, and how to go on, differ."""


def _interrupted(stage: str, retune: bool) -> str:
    """What Ctrl-C at ``stage`` kept, and the command that goes on from there."""
    if stage == START:
        return "before the search: no trial of this run was measured yet; re-run the same command"
    if stage == SEARCH:
        return (
            "during the search: the trial in progress is marked failed, every finished one is "
            "kept; re-run the same command to go on"
        )
    if stage == BASELINE:
        return (
            "while re-measuring the baseline: no trial of this re-tune was measured yet; re-run "
            "the same command"
        )
    n_trials = "retune.n_trials=0" if retune else "study.n_trials=0"
    return (
        "after the search (re-validation, control runs or confirmation): every trial and every "
        "finished re-validation run is kept; to finish without measuring new configurations, "
        f"re-run the same command with {n_trials}"
    )


def _recover(ctx: Context, study: optuna.Study, tracker: Tracker, recovery: Recovery) -> None:
    """Take over what interrupted invocations left: their trials and their MLflow runs."""
    recovery.check(study)
    for note in [
        *recovery.notes,
        *recover_runs(tracker, ctx.settings.study.name, recovery.grace_s),
    ]:
        ctx.out.print(f"recovered: {note}", markup=False)


def _set_aside(ctx: Context, study: optuna.Study) -> None:
    """Set aside (and say so) the trials measured under another workload fingerprint."""
    aside = set_aside(study, ctx.fingerprint)
    if aside:
        ctx.out.print(
            f"set aside: {sum(aside.values())} trial(s) measured under another workload "
            f"fingerprint ({', '.join(f'{fp[:12]}: {n}' for fp, n in aside.items())}; this "
            f"one is {ctx.fingerprint[:12]}): the workload's source or settings, the device or "
            "torch changed, so they are kept in the study but not reused or put on the front",
            markup=False,
        )


def _peak(
    out: Console,
    device: torch.device,
    device_name: str,
    space: SearchSpace,
    runs_dir: Path,
    why: str | None = None,
) -> Peak:
    """The device's peaks for the precisions the space searches, said in one line; ``why`` it is
    measured, where it is (by default: once, and kept in the runs directory)."""
    param = space.params.get("precision")
    precisions = [str(p) for p in (param.values() if param is not None else None) or ["fp32"]]
    cache = runs_dir / PEAKS_FILE

    why = why or f"once; kept in {cache}"

    def before_measuring() -> None:  # only where it measures: a kept peak is not measured again
        out.print(f"peak: measuring this machine's peak FLOP/s and bandwidth ({why})", markup=False)
        # once the fork server's imports are done: beside them it read half the idle peak
        wait_for_worker_server()

    peak, _ = device_peak(device, device_name, precisions, cache, before_measuring)
    flops = ", ".join(
        f"{p} {si(peak.flops_per_s[p])}FLOP/s" for p in precisions if p in peak.flops_per_s
    )
    out.print(f"peak: {flops}, {si(peak.bytes_per_s)}B/s ({peak.source})", markup=False)
    return peak


def _peak_again(ctx: Context) -> None:
    """A peak measured under load (or raised by a trial) is measured again once the trials are
    done, before the summary: the summary, the files and the runs' final metrics then take the
    best of every measurement (``device_peak``), not the one taken beside other work. A
    measurement that fails is said in one line, and the summary takes the peak in use."""
    if ctx.peak is None or not ctx.peak.under_load:
        return
    runs_dir = Path(ctx.settings.runs_dir)
    why = "again, before the summary: measured under load, or raised by a trial"
    try:
        peak = _peak(ctx.out, ctx.device, ctx.env["device_name"], ctx.space, runs_dir, why)
    except MEASURE_FAILURES as e:
        ctx.out.print(f"note: the peak could not be measured again ({e})", markup=False)
        return
    ctx.peaks.append(peak)


def _start_parent(
    ctx: Context,
    tracker: Tracker,
    cfg: Mapping[str, Any],
    base: Tuned | None,
    shared: list[str],
) -> None:
    """Say where the study runs, what shares its device (``shared``, warnings) and what cannot be
    measured, and start the invocation's parent run (tagged as a re-tune against ``base`` where
    given)."""
    out, settings, env = ctx.out, ctx.settings, ctx.env
    for warning in shared:
        out.print(f"[yellow]warning:[/] {warning}")
    energy_note = energy_unavailable_reason(ctx.device)
    if energy_note:
        out.print(
            f"energy: not measured here ({energy_note}); no energy figure is reported", markup=False
        )
    study_name = settings.study.name
    out.print(f"device: [bold]{env['device_name']}[/] ({ctx.device}), torch {env['torch']}")
    # A re-tune measures retune.n_trials after the baseline's front; study.n_trials is not used.
    trials = (
        f"the baseline's front, then {settings.retune.n_trials} new trials"
        if base is not None
        else f"{settings.study.n_trials} new trials"
    )
    out.print(
        f"study: {study_name} in {redact(settings.study.storage)} "
        f"({trials}, sampler {settings.study.sampler})"
    )
    kind = "retune" if base is not None else "tune"  # as history names it (Tuned.name)
    tracker.start_parent(
        f"{study_name} {kind} {time.strftime('%Y-%m-%d %H:%M:%S')}",
        params=_flatten({k: v for k, v in cfg.items() if k != "space"})
        | _flatten(cfg["space"], "space."),
        tags={
            "space": ctx.space.name,
            "study": study_name,
            "workload_fingerprint": ctx.fingerprint,
            "contention": "; ".join(shared) or "none seen",
            "energy": f"not measured: {energy_note}"
            if energy_note
            else "measured (energy_per_item_j)",
            "command": command_line(),
            **{k: str(v) for k, v in owner().items()},
            **{f"env.{k}": v for k, v in env.items()},
        },
    )
    if base is not None:
        tracker.set_tags(
            tracker.parent_id,
            {"retune": "true", "baseline": base.name, "baseline_run_id": base.mlflow_run_id or "-"},
        )


def _versions() -> dict[str, str]:
    try:
        return {"search_version": importlib.metadata.version("search")}
    except importlib.metadata.PackageNotFoundError:
        return {}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``tree`` (redacted: ``redact_tree``) as ``a.b.c`` keys."""
    flat: dict[str, Any] = {}
    for key, value in redact_tree(tree).items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
