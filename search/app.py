"""One invocation: validate everything, open the stores, run the study, report.

All validation happens before anything is written (``search.config``, ``search.prepare``), and a
store that cannot be opened removes the ``runs_dir`` this invocation created (``search.stores``),
so bad input leaves nothing behind. Once the parent run has started it is always ended: FINISHED,
KILLED (Ctrl-C) or FAILED.
"""

from __future__ import annotations

import importlib.metadata
import itertools
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

from search import results
from search.config import load_settings, redact, resolve, resolve_device
from search.gpu_telemetry import energy_unavailable_reason
from search.liveness import Heartbeat, Recovery, owner
from search.prepare import fingerprint, load_space
from search.records import COMPLETE, TrialRecord
from search.report import console, pareto_table, shown_metrics, si, summary_lines, trial_line
from search.revalidate import revalidate
from search.runner import TrialRequest, TrialResult, run_isolated
from search.settings import Settings
from search.space import SearchSpace
from search.stores import open_stores, quiet_libraries, recover_runs
from search.study import StudyDriver, StudyOutcome
from search.telemetry import contention, environment
from search.tracking import Tracker
from search.trial_store import save_revalidation, study_revalidations


@dataclass(frozen=True)
class Context:
    """What every step of one invocation reads: settings, the space, where it runs, the terminal."""

    settings: Settings
    space: SearchSpace
    device: torch.device
    env: Mapping[str, str]
    """The environment record (``search.telemetry.environment``) and this tool's version."""
    fingerprint: str
    out: Console

    def request(self, config: Mapping[str, Any]) -> TrialRequest:
        """The isolated worker's request to measure ``config``."""
        s = self.settings
        return TrialRequest(
            self.space.workload,
            config,
            str(self.device),
            s.seed,
            s.measure,
            timeout_s=s.runner.timeout_s,
            memory_limit_mb=s.runner.memory_limit_mb,
        )


def run(cfg_node: DictConfig) -> int:
    quiet_libraries()
    settings = load_settings(cfg_node)
    device = resolve_device(settings.device)
    space, notes = load_space(settings.space, device)
    out = console()
    for note in notes:
        out.print(f"[yellow]note:[/] {note}")
    recovery = Recovery(settings.study.heartbeat_s)
    study, tracker = open_stores(settings, space, recovery)
    if tracker.offline_reason:
        out.print(
            f"warning: {tracker.offline_reason}; going on without MLflow: results stay in the "
            "Optuna study, and `python -m search sync` with the same arguments copies them later",
            markup=False,
        )
    env = {**environment(device), **_versions()}
    ctx = Context(settings, space, device, env, fingerprint(space, env), out)
    cfg = resolve(cfg_node)  # as written, for the parent run's params and config.yaml
    _start_parent(ctx, tracker, cfg)
    status = "FAILED"
    heartbeat = Heartbeat(
        recovery.heartbeat_s, study._storage, lambda tags: tracker.set_tags(tracker.parent_id, tags)
    )
    try:
        recovery.check(study)
        for note in [
            *recovery.notes,
            *recover_runs(tracker, settings.study.name, recovery.grace_s),
        ]:
            out.print(f"recovered: {note}", markup=False)
        tracker.log_text(yaml.safe_dump(_redacted(cfg), sort_keys=False), "config.yaml")
        driver = _driver(ctx, study, tracker, recovery, heartbeat)
        outcome = driver.run()
        _finish(ctx, driver, outcome, tracker)
        if outcome.failure_stop:
            print(f"search: error: stopped early: {outcome.failure_stop}", file=sys.stderr)
            return 1
        status = "FINISHED"
        return 0
    except KeyboardInterrupt:
        status = "KILLED"
        out.print(
            "[red]interrupted[/]: the trial in progress is marked failed; "
            "re-run the same command to resume"
        )
        return 130
    finally:
        heartbeat.close()
        tracker.end_parent(status)


def _start_parent(ctx: Context, tracker: Tracker, cfg: Mapping[str, Any]) -> None:
    """Say where the study runs and what cannot be measured, and start the invocation's parent
    run."""
    out, settings, env = ctx.out, ctx.settings, ctx.env
    shared = contention(ctx.device)
    for warning in shared:
        out.print(f"[yellow]warning:[/] {warning}")
    energy_note = energy_unavailable_reason(ctx.device)
    if energy_note:
        out.print(
            f"energy: not measured here ({energy_note}); no energy figure is reported", markup=False
        )
    study_name = settings.study.name
    out.print(f"device: [bold]{env['device_name']}[/] ({ctx.device}), torch {env['torch']}")
    out.print(
        f"study: {study_name} in {redact(settings.study.storage)} "
        f"({settings.study.n_trials} new trials, sampler {settings.study.sampler})"
    )
    tracker.start_parent(
        f"{study_name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
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
            "command": redact(" ".join(["python -m search", *sys.argv[1:]])),
            **{k: str(v) for k, v in owner().items()},
            **{f"env.{k}": v for k, v in env.items()},
        },
    )


def _driver(
    ctx: Context, study: optuna.Study, tracker: Tracker, recovery: Recovery, heartbeat: Heartbeat
) -> StudyDriver:
    knob_names = list(ctx.space.searched)
    shown = shown_metrics([o.metric for o in ctx.space.objectives])
    tags = {
        "study": ctx.settings.study.name,
        "device": ctx.env["device_name"],
        "workload_fingerprint": ctx.fingerprint,
    }
    started = time.monotonic()

    def log_trial(record: TrialRecord, result: TrialResult) -> str | None:
        extra = {}
        if result.measurement is not None:
            extra["stop_reason"] = result.measurement.stop_reason
        if result.throttle_reasons:
            extra["throttle_reasons"] = result.throttle_reasons
        if record.state != COMPLETE and result.stderr_tail:
            extra["stderr_tail"] = result.stderr_tail[-4000:]
        return tracker.log_trial(record, result.duration_s, {**tags, **extra})

    measured = itertools.count(1)

    def progress(record: TrialRecord, history: list[TrialRecord]) -> None:
        front = results.stable_front(history, ctx.space)
        ctx.out.print(
            trial_line(
                record,
                next(measured),
                ctx.settings.study.n_trials,
                len(front),
                time.monotonic() - started,
                knob_names,
                ctx.settings.measure.confidence,
                shown,
            ),
            markup=False,
        )

    return StudyDriver(
        ctx.settings,
        ctx.space,
        study,
        ctx.fingerprint,
        ctx.request,
        log_trial,
        progress,
        recovery,
        heartbeat,
    )


def _revalidated_front(
    ctx: Context, study: optuna.Study, tracker: Tracker, front: list[TrialRecord]
) -> list[TrialRecord]:
    """Re-measure the search-time front in fresh processes; the front of what stays stable."""
    settings, out = ctx.settings, ctx.out
    processes = settings.revalidate.processes
    if processes == 0 or not front:
        return front
    candidates = results.revalidation_candidates(front, settings)
    done = study_revalidations(study, ctx.fingerprint)
    todo = [c for c in candidates if c.number not in done]
    if todo:
        out.print(
            f"\nre-validating {len(todo)} Pareto candidate(s) in {processes} fresh processes each, "
            "interleaved in random order:"
        )

    def measure(candidate: TrialRecord) -> TrialResult:
        return run_isolated(ctx.request(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        figure = (
            f"{si(result.measurement.throughput)} {candidate.unit}/s, "
            f"cv {result.measurement.throughput_cv:.1%}"
            if result.measurement
            else f"{result.state}: {result.failure}"
        )
        out.print(f"  [revalidate {i}/{n}] #{candidate.number}: {figure}", markup=False)

    seed = settings.seed + len(study.trials)
    pooled = revalidate(
        todo,
        processes,
        measure,
        seed,
        settings.stable.max_cv,
        settings.measure.confidence,
        progress,
    )
    for number, figures in pooled.items():
        save_revalidation(study, ctx.fingerprint, number, figures)
        done[number] = figures
        run_id = next(c.run_id for c in candidates if c.number == number)
        if run_id:
            results.log_revalidation(tracker, run_id, figures)
    revalidated = results.revalidated_front(candidates, done, ctx.space)
    dropped = results.left_the_front(candidates, revalidated, done)
    out.print(
        f"re-validation: {len(candidates) - len(dropped)} of {len(candidates)} candidate(s) "
        "kept their place" + (f"; left the front: {', '.join(dropped)}" if dropped else "")
    )
    return revalidated


def _finish(ctx: Context, driver: StudyDriver, outcome: StudyOutcome, tracker: Tracker) -> None:
    settings, space, out = ctx.settings, ctx.space, ctx.out
    history = driver.history()
    front = _revalidated_front(ctx, driver.study, tracker, results.stable_front(history, space))
    results.mark_front(tracker, outcome.study_name, front)
    best = results.recommend(front, settings.slo)
    study_dir = Path(settings.runs_dir) / outcome.study_name
    for path in results.write_files(
        study_dir, history, front, best, settings, space, ctx.env["device_name"]
    ):
        tracker.log_artifact(path)
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})
    for line in summary_lines(
        outcome,
        history,
        driver.recovery.notes if driver.recovery else (),
        best=best,
        max_cv=settings.stable.max_cv,
    ):
        out.print(line, markup=False)
    _print_front(ctx, front, best, history[0].unit if history else "items")
    out.print(f"files: {study_dir}/best.yaml, pareto.csv, pareto.png")
    if tracker.offline_reason:
        out.print(
            f"MLflow: {tracker.offline_reason}. {tracker.unlogged_trials} trial(s) of this run "
            "are in the Optuna study only; when the server is back, copy them with: "
            f"{_sync_command()}",
            markup=False,
        )
    else:
        out.print(f"compare runs in the MLflow UI: [bold]{redact(tracker.ui_command())}[/]")


def _print_front(
    ctx: Context, front: list[TrialRecord], best: TrialRecord | None, unit: str
) -> None:
    out, processes = ctx.out, ctx.settings.revalidate.processes
    if front:
        title = "Pareto-optimal stable configurations" + (
            f" (figures pooled from {processes} fresh processes each)"
            if processes
            else " (search-time figures)"
        )
        out.print(
            pareto_table(
                front,
                best,
                list(ctx.space.searched),
                unit,
                ctx.settings.measure.confidence,
                shown_metrics([o.metric for o in ctx.space.objectives]),
                title,
            )
        )
    else:
        out.print(
            "[yellow]no stable configuration yet[/]: nothing is on the front; "
            "see the trial lines above"
        )
    if best is None and front:
        out.print("[yellow]no Pareto configuration meets the slo[/]; best.yaml records none")


def _versions() -> dict[str, str]:
    try:
        return {"search_version": importlib.metadata.version("search")}
    except importlib.metadata.PackageNotFoundError:
        return {}


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = redact(value) if isinstance(value, str) else value
    return flat


def _redacted(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _redacted(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_redacted(v) for v in tree]
    return redact(tree) if isinstance(tree, str) else tree


def _sync_command() -> str:
    return redact(" ".join(["python -m search sync", *sys.argv[1:]]))
