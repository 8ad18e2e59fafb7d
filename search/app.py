"""One invocation: validate everything, open the stores, run the study, report.

All validation happens before anything is written (``search.config``, ``search.prepare``), and a
store that cannot be opened removes what this invocation created in ``runs_dir``
(``search.stores``), so bad input leaves nothing behind. Once the parent run has started it is
always ended: FINISHED, KILLED (Ctrl-C) or FAILED.
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
from search.config import load_settings, redact, redact_tree, resolve, resolve_device
from search.gpu_telemetry import energy_unavailable_reason
from search.liveness import Heartbeat, Recovery, owner
from search.noise import NoiseFloor
from search.prepare import control_config, fingerprint, load_space
from search.records import COMPLETE, TrialRecord
from search.report import (
    console,
    knobs_text,
    pareto_table,
    shown_metrics,
    si,
    summary_lines,
    trial_line,
    write_noise_plot,
)
from search.revalidate import Pooled, revalidate
from search.runner import TrialRequest, TrialResult, run_isolated
from search.settings import Settings
from search.space import SearchSpace
from search.stores import open_stores, quiet_libraries, recover_runs
from search.study import StudyDriver, StudyOutcome
from search.telemetry import contention, environment
from search.tracking import Tracker
from search.trial_store import judged_revalidations, save_revalidation, set_aside


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
    control: Mapping[str, Any] | None
    """The control configuration (``search.prepare.control_config``); None: no control runs."""

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
    control = control_config(space, settings.noise.control) if settings.noise.budget > 0 else None
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
    ctx = Context(settings, space, device, env, fingerprint(space, env), out, control)
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
        tracker.log_text(yaml.safe_dump(redact_tree(cfg), sort_keys=False), "config.yaml")
        aside = set_aside(study, ctx.fingerprint)
        if aside:
            out.print(
                f"set aside: {sum(aside.values())} trial(s) measured under another workload "
                f"fingerprint ({', '.join(f'{fp[:12]}: {n}' for fp, n in aside.items())}; this "
                f"one is {ctx.fingerprint[:12]}): the workload's source or settings, the device or "
                "torch changed, so they are kept in the study but not reused or put on the front",
                markup=False,
            )
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
            extra["stderr_tail"] = redact(result.stderr_tail[-4000:])
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

    controls = itertools.count(1)

    def on_control(result: TrialResult, floor: NoiseFloor) -> None:
        n = next(controls)
        m = result.measurement
        figure = (
            f"{si(m.throughput)} {result.unit}/s, cv {m.throughput_cv:.1%}"
            if m is not None and result.state == COMPLETE
            else f"{result.state}: {result.failure}"
        )
        ctx.out.print(f"  [control {n}] {figure}", markup=False)
        if n == ctx.settings.noise.start_runs:
            ctx.out.print(floor.line(), markup=False)

    if ctx.control is not None:
        ctx.out.print(
            f"control: {knobs_text(ctx.control, list(ctx.space.searched))}, measured in fresh "
            f"processes at the start, during the study (at most "
            f"{ctx.settings.noise.budget:.0%} of its time) and at the end:",
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
        ctx.control,
        on_control,
    )


REVALIDATION_ROUNDS = 3
"""Rounds of re-validation at the end of a study: a round after the first runs only when nothing
re-validated is left on the front, and re-validates what the failures exposed."""


def _revalidate(ctx: Context, study: optuna.Study, todo: list[TrialRecord]) -> None:
    """Re-measure ``todo`` (front configurations not re-validated yet) in fresh processes."""
    settings, out = ctx.settings, ctx.out
    processes = settings.revalidate.processes
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
    pooled = revalidate(todo, processes, measure, seed, settings.measure.confidence, progress)
    for number, figures in pooled.items():
        save_revalidation(study, ctx.fingerprint, number, figures)


def _log_final(
    ctx: Context,
    tracker: Tracker,
    floor: NoiseFloor,
    mine: list[TrialRecord],
    done: Mapping[int, Pooled],
    study_dir: Path,
    control_s: float,
) -> None:
    """The figures as the final noise floor gives them, on MLflow: the floor and the control's
    level over time on the parent run (with ``noise.png``); the intervals spanning runs, the
    verdict and the re-validated figures on the runs of this invocation's trials (a later step of
    the same metrics)."""
    tracker.log_metrics(tracker.parent_id, {**floor.metrics(), "noise_control_time_s": control_s})
    for i, control in enumerate(floor.controls):
        tracker.log_metrics(
            tracker.parent_id,
            {"control_throughput": control.throughput, "control_cv": control.cv},
            step=i,
            timestamp_ms=int(control.time_s * 1000),
        )
    if floor.controls:
        path = study_dir / "noise.png"
        unit = mine[0].unit if mine else "items"
        write_noise_plot(path, floor, f"{ctx.space.name} on {ctx.env['device_name']}", unit)
        tracker.log_artifact(path)
    for record in mine:
        if record.run_id and record.state == COMPLETE:
            keys = ("throughput", "throughput_ci_low", "throughput_ci_high")
            tracker.log_metrics(record.run_id, {k: record.metrics[k] for k in keys}, step=1)
            tracker.set_tags(
                record.run_id,
                {"stable": str(record.stable).lower(), "unstable_reason": record.reason or "-"},
            )
            if record.number in done:
                results.log_revalidation(tracker, record.run_id, done[record.number])


def _finish(ctx: Context, driver: StudyDriver, outcome: StudyOutcome, tracker: Tracker) -> None:
    settings, space, out = ctx.settings, ctx.space, ctx.out
    study, fp = driver.study, ctx.fingerprint
    # When every candidate fails re-validation, what they dominated is re-validated in turn (at
    # most REVALIDATION_ROUNDS rounds), so that one bad round does not leave nothing to recommend.
    for round_ in range(REVALIDATION_ROUNDS if settings.revalidate.processes else 0):
        done = judged_revalidations(study, fp, settings)
        history = driver.history()
        if round_ and results.final_front(history, done, settings, space):
            break
        todo = results.next_candidates(history, done, settings, space)
        if not todo:
            break
        _revalidate(ctx, study, todo)
    driver.run_control()  # the end of the study: drift needs both ends
    floor = driver.floor()
    history = driver.history()
    done = judged_revalidations(study, fp, settings)
    front = results.final_front(history, done, settings, space)
    if settings.revalidate.processes and done:
        dropped = results.left_the_front(history, front, done)
        out.print(
            f"re-validation: {len(done) - len(dropped)} of {len(done)} re-validated "
            "configuration(s) on the front"
            + (f"; not on it: {', '.join(dropped)}" if dropped else "")
        )
    results.mark_front(tracker, outcome.study_name, front)
    best = results.recommend(front, settings.slo)
    study_dir = Path(settings.runs_dir) / outcome.study_name
    final = results.with_revalidation(history, done)  # every file shows the final verdicts
    for path in results.write_files(
        study_dir, final, front, best, settings, space, ctx.env["device_name"]
    ):
        tracker.log_artifact(path)
    mine = {r.number for r in outcome.records}
    _log_final(
        ctx,
        tracker,
        floor,
        [r for r in history if r.number in mine],
        done,
        study_dir,
        driver.control_s,
    )
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})
    for line in summary_lines(
        outcome,
        history,
        driver.recovery.notes if driver.recovery else (),
        noise_line="\n".join(
            results.noise_lines(floor, settings.measure.confidence)
            + (
                [
                    f"  the control runs of this invocation took {driver.control_s:.0f} s, "
                    f"{driver.control_s / driver.elapsed_s():.0%} of its {driver.elapsed_s():.0f} s"
                ]
                if driver.control_runs
                else []
            )
        ),
        passed_over=results.passed_over(history, front, best, done, settings.slo, space),
    ):
        out.print(line, markup=False)
    _print_front(ctx, front, best, history[0].unit if history else "items")
    noise_png = ", noise.png" if floor.controls else ""
    out.print(f"files: {study_dir}/best.yaml, pareto.csv, pareto.png{noise_png}")
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
    """``tree`` (redacted: ``redact_tree``) as ``a.b.c`` keys."""
    flat: dict[str, Any] = {}
    for key, value in redact_tree(tree).items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _sync_command() -> str:
    return redact(" ".join(["python -m search sync", *sys.argv[1:]]))
