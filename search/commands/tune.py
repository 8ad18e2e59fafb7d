"""One invocation: validate everything, open the stores, run the study, report.

All validation happens before anything is written (``search.config.compose``,
``search.config.prepare``), and a
store that cannot be opened removes what this invocation created in ``runs_dir``
(``search.study.stores``), so bad input leaves nothing behind. Once the parent run has started it is
always ended: FINISHED, KILLED (Ctrl-C) or FAILED.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
import torch
import yaml
from omegaconf import DictConfig
from rich.console import Console

from search.analysis.diagnosis import Diagnosis, Peak, device_peak, diagnose, doubling, table_peak
from search.analysis.noise_floor import NoiseFloor
from search.config.compose import (
    ConfigError,
    for_logging,
    load_settings,
    redact,
    redact_tree,
    resolve_device,
)
from search.config.prepare import control_config, fingerprint, load_space
from search.config.settings import Settings
from search.core.records import COMPLETE, TrialRecord
from search.execution.worker import TrialRequest, TrialResult, run_isolated
from search.measurement.environment import contention, device_label, environment
from search.measurement.gpu import energy_unavailable_reason
from search.reporting import results
from search.reporting.oracle import oracle, oracle_lines, oracle_values, write_oracle_plot
from search.reporting.report import (
    DESCRIPTION_CHARS,
    console,
    front_cells,
    knobs_text,
    pareto_table,
    shown_metrics,
    si,
    summary_lines,
    summary_markdown,
    trial_line,
    write_noise_plot,
)
from search.retune.nightly import (
    MIN_RUNS,
    MOVED,
    RETUNE,
    TUNE,
    Figure,
    Tuned,
    baseline,
    conclude,
    confirm,
    save_tuned,
    tuned_runs,
    write_history,
    write_report,
)
from search.space.search_space import SearchSpace
from search.study.driver import StudyDriver, StudyOutcome, optuna_names, repeat_run
from search.study.guards import KnownOutcomes, config_key
from search.study.liveness import Heartbeat, Recovery, owner
from search.study.revalidate import Pooled, Run, revalidate
from search.study.stores import open_stores, quiet_libraries, recover_runs, require_study
from search.study.trial_store import (
    judged_revalidations,
    save_revalidation,
    save_revalidation_run,
    set_aside,
    unfinished_revalidations,
)
from search.tracking.tracker import Tracker

__all__ = ["Context", "Finished", "REVALIDATION_ROUNDS", "Spent", "run"]


@dataclass
class Spent:
    """Where an invocation's wall time went, s: what the time budget (docs/method/time.md) is
    judged on."""

    started_s: float = field(default_factory=time.monotonic)
    new_s: float = 0.0
    """Measuring the configurations of this invocation's trials."""
    new_trials: int = 0
    control_s: float = 0.0
    revalidation_s: float = 0.0
    confirmation_s: float = 0.0

    def took(self, driver: StudyDriver) -> None:
        """Take the study driver's figures (after its last control run)."""
        self.new_s, self.control_s = driver.new_s, driver.control_s
        self.new_trials = len(driver.outcome.records)

    def line(self) -> str:
        total = time.monotonic() - self.started_s
        parts = [
            f"control runs {self.control_s:.0f} s",
            f"re-validation {self.revalidation_s:.0f} s",
            f"confirmation {self.confirmation_s:.0f} s",
        ]
        other = total - self.new_s - self.control_s - self.revalidation_s - self.confirmation_s
        return (
            f"time: {self.new_s / total:.0%} of {total:.0f} s measured {self.new_trials} new "
            f"configuration(s) ({self.new_s:.0f} s); {', '.join(parts)}, the rest {other:.0f} s "
            "(start-up, stores, files)"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "time_total_s": time.monotonic() - self.started_s,
            "time_new_configurations_s": self.new_s,
            "time_control_s": self.control_s,
            "time_revalidation_s": self.revalidation_s,
            "time_confirmation_s": self.confirmation_s,
        }


@dataclass(frozen=True)
class Context:
    """What every step of one invocation reads: settings, the space, where it runs, the terminal."""

    settings: Settings
    space: SearchSpace
    device: torch.device
    env: Mapping[str, str]
    """The environment record (``search.measurement.environment.environment``) and this tool's
    version."""
    fingerprint: str
    out: Console
    control: Mapping[str, Any] | None
    """The control configuration (``search.config.prepare.control_config``); None: no control
    runs."""
    peak: Peak | None = None
    """The device's peak FLOP/s and bandwidth, for the regime diagnosis
    (``search.analysis.diagnosis``)."""
    spent: Spent = field(default_factory=Spent)
    """Where this invocation's time went."""

    def diagnosis(
        self, record: TrialRecord, history: Sequence[TrialRecord] = ()
    ) -> Diagnosis | None:
        """``record``'s regime on this device, with its batch-doubling pair from ``history``."""
        if self.peak is None or record.state != COMPLETE:
            return None
        precision = str(record.config.get("precision", "fp32"))
        return diagnose(record.metrics, precision, self.peak, doubling(record, history))

    def repeat(self, config: Mapping[str, Any]) -> TrialRequest:
        """The worker's request to measure ``config`` again (``search.study.driver.repeat_run``)."""
        return repeat_run(self.request(config), self.settings)

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


def run(cfg_node: DictConfig, kind: str = TUNE) -> int:
    """A tuning (``kind`` ``tune``) or a re-tune against the study's last tuning (``retune``)."""
    spent = Spent()
    quiet_libraries()
    settings = load_settings(cfg_node)
    device = resolve_device(settings.device)
    space, notes = load_space(settings.space, device, settings.slo)
    control = control_config(space, settings.noise.control) if settings.noise.budget > 0 else None
    if kind == RETUNE:
        if settings.retune.confirm == 0:
            raise ConfigError(
                "retune.confirm=0: a re-tune compares confirmation runs of today's "
                f"recommendation with the baseline's; use retune.confirm >= {MIN_RUNS}"
            )
        require_study(settings.study.name, settings.study.storage)
    elif settings.study.n_trials == 0:  # a summary of what workers stored: a study must exist
        require_study(settings.study.name, settings.study.storage)
    out = console()
    for note in notes:
        out.print(f"[yellow]note:[/] {note}")
    recovery = Recovery(settings.study.heartbeat_s)
    study, tracker = open_stores(settings, space, recovery)
    base = (
        baseline(study, settings.retune.baseline, environment(device)["device_name"])
        if kind == RETUNE
        else None
    )
    if tracker.offline_reason:
        out.print(
            f"warning: {tracker.offline_reason}; going on without MLflow: results stay in the "
            "Optuna study, and `python -m search sync` with the same arguments copies them later",
            markup=False,
        )
    env = {**environment(device), **_versions()}
    peak = _peak(out, device, env["device_name"], space, Path(settings.runs_dir))
    ctx = Context(
        settings, space, device, env, fingerprint(space, env), out, control, peak, spent=spent
    )
    cfg = for_logging(cfg_node)  # as written, for the parent run's params and config.yaml
    _start_parent(ctx, tracker, cfg)
    if base is not None:
        tracker.set_tags(
            tracker.parent_id,
            {"retune": "true", "baseline": base.name, "baseline_run_id": base.mlflow_run_id or "-"},
        )
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
        remeasured: dict[str, Pooled] = {}
        if base is not None:
            remeasured = _remeasure(ctx, study, base)
            ctx = _warm_start(ctx, study, base)
        driver = _driver(ctx, study, tracker, recovery, heartbeat)
        for note in driver.notes:
            out.print(f"note: {note}", markup=False)
        outcome = driver.run()
        if remeasured:
            _adopt(ctx, driver, remeasured)
        finished = _finish(ctx, driver, outcome, tracker)
        spent.took(driver)
        code = _conclude(ctx, study, tracker, base, finished)
        if outcome.failure_stop:
            print(f"search: error: stopped early: {outcome.failure_stop}", file=sys.stderr)
            return 1
        status = "FINISHED"
        return code
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


def _peak(
    out: Console, device: torch.device, device_name: str, space: SearchSpace, runs_dir: Path
) -> Peak:
    """The device's peaks for the precisions the space searches, said in one line."""
    param = space.params.get("precision")
    precisions = [str(p) for p in (param.values() if param is not None else None) or ["fp32"]]
    cache = runs_dir / "peaks.json"
    if table_peak(device_name) is None:
        out.print(
            f"peak: measuring this machine's peak FLOP/s and bandwidth (once; kept in {cache})"
        )
    peak, _ = device_peak(device, device_name, precisions, cache)
    flops = ", ".join(f"{p} {si(peak.flops_per_s[p])}FLOP/s" for p in precisions)
    out.print(f"peak: {flops}, {si(peak.bytes_per_s)}B/s ({peak.source})", markup=False)
    return peak


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
        "measured_on": device_label(ctx.env),
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
        had_error = tracker.log_error is not None
        run_id = tracker.log_trial(record, result.duration_s, {**tags, **extra})
        if record.state == COMPLETE:  # the parent's charts: the study's progress, trial by trial
            keys = ("throughput", "throughput_ci_low")
            tracker.log_metrics(
                tracker.parent_id,
                {f"trial_{k}": record.metrics[k] for k in keys},
                step=record.number,
            )
        if tracker.log_error is not None and not had_error:
            ctx.out.print(
                f"warning: {tracker.log_error}; going on: the trial is in the Optuna study, "
                f"and {_sync_command()} copies it later",
                markup=False,
            )
        return run_id

    measured = itertools.count(1)

    def progress(record: TrialRecord, history: list[TrialRecord]) -> None:
        front = results.stable_front(history, ctx.space)
        diagnosis = ctx.diagnosis(record, history)
        if diagnosis is not None and record.run_id:  # with the study's batch-doubling pairs
            tracker.log_metrics(record.run_id, diagnosis.metrics())
            tracker.set_tags(
                record.run_id, {"regime": diagnosis.regime, "regime_why": diagnosis.why}
            )
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
                diagnosis,
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
        warn=lambda line: ctx.out.print(line, markup=False),
        where=device_label(ctx.env),
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
        return run_isolated(ctx.repeat(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        figure = (
            f"{si(result.measurement.throughput)} {candidate.unit}/s, "
            f"cv {result.measurement.throughput_cv:.1%}"
            if result.measurement
            else f"{result.state}: {result.failure}"
        )
        out.print(f"  [revalidate {i}/{n}] #{candidate.number}: {figure}", markup=False)

    kept = unfinished_revalidations(study, ctx.fingerprint)
    resumed = {c.number: len(kept[c.number]) for c in todo if kept.get(c.number)}
    if resumed:
        out.print(
            "  resuming an interrupted re-validation: "
            + ", ".join(f"#{n} has {k} of {processes} runs" for n, k in resumed.items()),
            markup=False,
        )

    def keep(candidate: TrialRecord, run: Run) -> None:
        save_revalidation_run(study, ctx.fingerprint, candidate.number, run)

    seed = settings.seed + len(study.trials)
    pooled = revalidate(
        todo, processes, measure, seed, settings.measure.confidence, progress, kept, keep
    )
    here = device_label(ctx.env)  # the device that measured the replicates, for their drift line
    for number, figures in pooled.items():
        runs = tuple(replace(r, device=here) for r in figures.runs)
        save_revalidation(study, ctx.fingerprint, number, replace(figures, runs=runs))


def _log_final(
    ctx: Context,
    tracker: Tracker,
    floor: NoiseFloor,
    mine: list[TrialRecord],
    done: Mapping[int, Pooled],
    study_dir: Path,
    control_s: float,
    diagnoses: Mapping[int, Diagnosis],
    paired: Sequence[TrialRecord] = (),
) -> None:
    """The figures as the final noise floor gives them, on MLflow: the floor and the control's
    level over time on the parent run (with ``noise.png``); the intervals spanning runs, the
    verdict, the re-validated figures and the regime (with the study's batch-doubling pairs) on
    the runs of this invocation's trials (a later step of the same metrics), and the regime on
    earlier trials ``paired`` with one of them."""
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
            keys = [
                f"{name}{end}"
                for name in ("throughput", "requests_per_s")
                for end in ("", "_ci_low", "_ci_high")
            ]
            final = {k: record.metrics[k] for k in keys if k in record.metrics}
            tracker.log_metrics(record.run_id, final, step=1)
            tracker.set_tags(
                record.run_id,
                {"stable": str(record.stable).lower(), "unstable_reason": record.reason or "-"},
            )
            if record.number in done:
                results.log_revalidation(tracker, record.run_id, done[record.number])
    for record in [*mine, *paired]:
        diagnosis = diagnoses.get(record.number)
        if record.run_id and diagnosis is not None:
            tracker.log_metrics(record.run_id, diagnosis.metrics(), step=1)
            tracker.set_tags(
                record.run_id, {"regime": diagnosis.regime, "regime_why": diagnosis.why}
            )


@dataclass(frozen=True)
class Finished:
    """What a study ended with."""

    front: list[TrialRecord]
    best: TrialRecord | None
    floor: NoiseFloor
    unit: str
    description: str = ""
    """The parent run's description (markdown): the summary."""


def _finish(ctx: Context, driver: StudyDriver, outcome: StudyOutcome, tracker: Tracker) -> Finished:
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
        started = time.monotonic()
        _revalidate(ctx, study, todo)
        ctx.spent.revalidation_s += time.monotonic() - started
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
    diagnoses = {r.number: d for r in final if (d := ctx.diagnosis(r, final)) is not None}

    def diagnosed(r: TrialRecord) -> TrialRecord:  # the files carry the diagnosis's figures
        d = diagnoses.get(r.number)
        return r if d is None else replace(r, metrics={**r.metrics, **d.metrics()})

    for path in results.write_files(
        study_dir,
        final,
        [diagnosed(r) for r in front],
        diagnosed(best) if best is not None else None,
        settings,
        space,
        ctx.env["device_name"],
    ):
        tracker.log_artifact(path)
    mine = {r.number for r in outcome.records}
    paired = [
        r
        for r in final
        if r.number not in mine and (pair := doubling(r, final)) is not None and pair[0] in mine
    ]
    _log_final(
        ctx,
        tracker,
        floor,
        [r for r in history if r.number in mine],
        done,
        study_dir,
        driver.control_s,
        diagnoses,
        paired,
    )
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})
    noise = results.noise_lines(floor, settings.measure.confidence) + (
        [
            f"  the control runs of this invocation took {driver.control_s:.0f} s, "
            f"{driver.control_s / driver.elapsed_s():.0%} of its {driver.elapsed_s():.0f} s"
        ]
        if driver.control_runs
        else []
    )
    for line in summary_lines(
        outcome,
        history,
        driver.recovery.notes if driver.recovery else (),
        noise_line="\n".join(noise),
        passed_over=results.passed_over(history, front, best, done, settings.slo, space),
    ):
        out.print(line, markup=False)
    unit = history[0].unit if history else "items"
    _print_front(ctx, front, best, unit, diagnoses)
    regimes = _regime_lines(diagnoses, best)
    rows = oracle(final, {k: oracle_values(p) for k, p in space.searched.items()}, settings.slo)
    shown = shown_metrics([o.metric for o in space.objectives])
    oracle_text = oracle_lines(rows, list(space.searched), unit, shown[:2])
    for line in regimes + oracle_text:
        out.print(line, markup=False)
    if rows:
        write_oracle_plot(
            study_dir / "oracle.png",
            rows,
            unit,
            f"{space.name} on {ctx.env['device_name']}: best stable throughput at each value",
        )
        tracker.log_artifact(study_dir / "oracle.png")
    cells = front_cells(
        front, best, list(space.searched), unit, settings.measure.confidence, shown, diagnoses
    )
    sections = {"The machine's noise": noise, "Regimes": regimes, "Oracle": oracle_text}
    title = f"{outcome.study_name} on {ctx.env['device_name']}"
    confidence = settings.measure.confidence
    summary = study_dir / "summary.md"
    summary.write_text(summary_markdown(title, cells, best, unit, confidence, sections, None))
    tracker.log_artifact(summary)
    description = summary_markdown(title, cells, best, unit, confidence, sections)
    tracker.describe(tracker.parent_id, description)
    noise_png = ", noise.png" if floor.controls else ""
    out.print(f"files: {study_dir}/best.yaml, pareto.csv, pareto.png, oracle.png{noise_png}")
    if tracker.offline_reason or tracker.log_error:
        out.print(
            f"MLflow: {tracker.offline_reason or tracker.log_error}. {tracker.unlogged_trials} "
            "trial(s) of this run are in the Optuna study only; when MLflow works again, copy "
            f"them with: {_sync_command()}",
            markup=False,
        )
    else:
        out.print(f"compare runs in the MLflow UI: [bold]{redact(tracker.ui_command())}[/]")
        url = tracker.ui_url(outcome.study_name)
        if url:
            out.print(f"  the front, compared: {url}", markup=False)
    return Finished(front, best, floor, unit, description)


# -- the reference step and the re-tune ------------------------------------------------------


def _remeasure(ctx: Context, study: optuna.Study, base: Tuned) -> dict[str, Pooled]:
    """The baseline's recommendation and up to ``retune.remeasure`` more of its front, measured
    in fresh processes, interleaved: ``{config key: pooled figures}``."""
    settings, out = ctx.settings, ctx.out
    assert base.recommended is not None
    wanted = [base.recommended] + [f for f in base.front if f.config != base.recommended.config][
        : settings.retune.remeasure
    ]
    figures = [f for f in wanted if ctx.space.contains(f.config)]
    for f in wanted:
        if f not in figures:
            out.print(
                f"note: {knobs_text(f.config, list(ctx.space.searched))} of the baseline lies "
                "outside the space now: not re-measured",
                markup=False,
            )
    if not figures:
        return {}
    processes = settings.retune.processes
    out.print(
        f"\nre-measuring the baseline ({base.name})'s recommendation and {len(figures) - 1} more "
        f"of its front, {processes} fresh processes each, interleaved:",
        markup=False,
    )
    candidates = [
        TrialRecord(-1 - i, f.config, COMPLETE, {}, True, unit=base.unit)
        for i, f in enumerate(figures)
    ]

    def measure(candidate: TrialRecord) -> TrialResult:
        return run_isolated(ctx.repeat(candidate.config))

    def progress(i: int, n: int, candidate: TrialRecord, result: TrialResult) -> None:
        m = result.measurement
        figure = (
            f"{si(m.throughput)} {candidate.unit}/s, cv {m.throughput_cv:.1%}"
            if m is not None
            else f"{result.state}: {result.failure}"
        )
        knobs = knobs_text(candidate.config, list(ctx.space.searched))
        out.print(f"  [remeasure {i}/{n}] {knobs}: {figure}", markup=False)

    pooled = revalidate(
        candidates,
        processes,
        measure,
        settings.seed + len(study.trials),
        settings.measure.confidence,
        progress,
    )
    return {config_key(c.config): pooled[c.number] for c in candidates}


def _warm_start(ctx: Context, study: optuna.Study, base: Tuned) -> Context:
    """Queue the baseline's front (its recommendation first) for the search, and measure
    ``retune.n_trials`` new configurations after it. Configurations measured already under this
    fingerprint (an unchanged model) are not queued: their re-measured runs stand for them."""
    names, _ = optuna_names(study, ctx.space)
    known = KnownOutcomes.load(
        study, ctx.space, ctx.fingerprint, ctx.settings.runner.memory_limit_mb
    )
    queued = 0
    front = [base.recommended, *base.front] if base.recommended is not None else list(base.front)
    seen: set[str] = set()
    for f in front:
        key = config_key(f.config)
        if key in seen or not ctx.space.contains(f.config) or known.measured(f.config):
            continue  # a configuration measured already under this fingerprint is not queued
        seen.add(key)
        study.enqueue_trial(
            {names[k]: v for k, v in f.config.items() if k in ctx.space.searched},
            user_attrs={"proposed_by": f"the front of {base.name}"},
        )
        queued += 1
    settings = ctx.settings
    n_trials = settings.retune.n_trials + queued
    ctx.out.print(
        f"search: the baseline's front first ({queued} configuration(s)), then "
        f"{settings.retune.n_trials} new one(s)",
        markup=False,
    )
    return replace(
        ctx, settings=replace(settings, study=replace(settings.study, n_trials=n_trials))
    )


def _adopt(ctx: Context, driver: StudyDriver, remeasured: Mapping[str, Pooled]) -> None:
    """The re-measured runs of a configuration serve as the re-validation of its latest trial
    (replacing an earlier one): it is not re-measured at the end, and its figures are today's."""
    latest = {config_key(r.config): r for r in driver.history()}
    for key, pooled in remeasured.items():
        if key in latest and pooled.runs:
            save_revalidation(driver.study, ctx.fingerprint, latest[key].number, pooled)


def _confirm(
    ctx: Context, tracker: Tracker, best: TrialRecord, unit: str, old: Figure | None
) -> tuple[Figure | None, Figure | None]:
    """The recommendation confirmed in ``retune.confirm`` rounds of fresh runs after it was
    chosen, each round a run of the reference step and then the recommendation (and the old
    recommendation ``old`` of a re-tune, where it is another configuration still in the space):
    their confirmed figures (``search.retune.nightly.confirm``), None where confirmation is off or
    too
    many runs failed."""
    settings, out = ctx.settings, ctx.out
    rounds = settings.retune.confirm
    if rounds == 0:
        return None, None
    knobs = list(ctx.space.searched)
    other = (
        old.config
        if old is not None and old.config != best.config and ctx.space.contains(old.config)
        else None
    )
    configs = [best.config] + ([other] if other is not None else [])
    out.print(
        f"\nconfirming the recommendation #{best.number} ({knobs_text(best.config, knobs)}) in "
        f"{rounds} fresh runs after it was chosen (the figure a re-tune compares with)"
        + (f", each with the old one ({knobs_text(other, knobs)})" if other is not None else "")
        + (
            ", each after a run of the reference step (a fixed tiny GPT and matrix product, "
            "not your model: the machine's speed):"
            if settings.retune.reference
            else ":"
        ),
        markup=False,
    )

    def shown(result: TrialResult | None, what_unit: str) -> str:
        if result is None or result.measurement is None:
            return f"{getattr(result, 'state', 'not run')}: {getattr(result, 'failure', '')}"
        return f"{si(result.measurement.throughput)} {what_unit}/s"

    def progress(i: int, n: int, ref: TrialResult | None, results: list[TrialResult]) -> None:
        out.print(
            f"  [confirm {i}/{n}] "
            + "; ".join(
                f"{who} {shown(r, unit)}"
                for who, r in zip(("recommendation", "old one"), results, strict=False)
            )
            + (f"; reference step {shown(ref, 'tokens')}" if ref is not None else ""),
            markup=False,
        )

    confirmed = confirm(
        configs,
        ctx.repeat,
        str(ctx.device),
        rounds,
        settings.seed + best.number,
        settings.measure.confidence,
        progress,
        settings.retune.reference,
    )
    for failure in confirmed.failures:
        out.print(f"  not counted: {failure}", markup=False)
    figure = confirmed.figures[0]
    # the old recommendation today: measured beside today's, or today's own runs when it is the
    # same configuration; none when it lies outside the space now
    same = old is None or old.config == best.config
    old_today = confirmed.figures[1] if other is not None else (figure if same else None)
    if figure is None:
        out.print(
            f"confirmed: no (fewer than {MIN_RUNS} of {rounds} rounds complete): this run cannot "
            "be a re-tune's baseline",
            markup=False,
        )
        return None, old_today
    ref = figure.reference
    out.print(
        f"confirmed: {si(figure.throughput)} [{si(figure.low)}, {si(figure.high)}] {unit}/s "
        f"(95% CI, {len(figure.runs)} fresh runs)"
        + (
            f"; reference step {si(ref.throughput)} [{si(ref.low)}, {si(ref.high)}] tokens/s"
            if ref is not None
            else ""
        ),
        markup=False,
    )
    metrics = {
        "confirmed_throughput": figure.throughput,
        "confirmed_throughput_ci_low": figure.low,
        "confirmed_throughput_ci_high": figure.high,
    }
    if ref is not None:
        metrics["reference_throughput"] = ref.throughput
    tracker.log_metrics(tracker.parent_id, metrics)
    return replace(figure, trial=best.number), old_today


def _conclude(
    ctx: Context, study: optuna.Study, tracker: Tracker, base: Tuned | None, finished: Finished
) -> int:
    """Confirm the recommendation and keep what this run concluded in the study; for a re-tune,
    compare with the baseline, report and return the exit code (3 on a regression)."""
    settings, out = ctx.settings, ctx.out
    best = finished.best
    old = base.recommended if base is not None else None
    started = time.monotonic()
    confirmed, old_today = (
        _confirm(ctx, tracker, best, finished.unit, old) if best is not None else (None, None)
    )
    ctx.spent.confirmation_s += time.monotonic() - started
    # before a re-tune's verdict, which stays the last line (scripts read it)
    out.print(ctx.spent.line(), markup=False)
    tracker.log_metrics(tracker.parent_id, ctx.spent.metrics())
    now = time.time()
    kind = TUNE if base is None else RETUNE
    today = Tuned(
        kind,
        f"{kind} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}",
        now,
        ctx.fingerprint,
        {k: str(v) for k, v in ctx.env.items()},
        ctx.env["device_name"],
        finished.unit,
        confirmed if confirmed is not None else (Figure.of(best) if best is not None else None),
        tuple(Figure.of(r) for r in finished.front),
        tracker.parent_id,
    )
    code = 0
    study_dir = Path(settings.runs_dir) / settings.study.name
    if base is not None:
        conclusion = conclude(
            base, today, old_today, settings.retune.threshold, settings.measure.confidence
        )
        today = replace(today, verdict=conclusion.verdict)
        out.print("")
        for c in conclusion.comparisons:
            out.print(f"  {c.line()}", markup=False)
        for change in conclusion.changed:
            out.print(f"  changed: {change}", markup=False)
        if conclusion.hint:
            out.print(f"  {conclusion.hint}", markup=False)
        knobs = list(ctx.space.searched)
        for who, t in (("baseline", base), ("today", today)):
            r = t.recommended
            figure = (
                f"{knobs_text(r.config, knobs)}: {si(r.throughput)} [{si(r.low)}, {si(r.high)}] "
                f"{t.unit}/s"
                if r is not None
                else "none"
            )
            out.print(f"  recommendation, {who} ({t.name}): {figure}", markup=False)
        if conclusion.verdict == MOVED:
            assert base.recommended is not None and today.recommended is not None
            out.print(
                f"  optimum moved: {knobs_text(base.recommended.config, knobs)} -> "
                f"{knobs_text(today.recommended.config, knobs)}",
                markup=False,
            )
        md, js = write_report(study_dir, base, today, conclusion, list(ctx.space.searched))
        tracker.set_tags(tracker.parent_id, {"verdict": conclusion.verdict})
        verdict = [c.line() for c in conclusion.comparisons] + [conclusion.line]
        head = "### Re-tune\n\n```\n" + "\n".join(verdict) + "\n```\n\n"
        rest = finished.description
        if len(head) + len(rest) > DESCRIPTION_CHARS:
            rest = "(the study's summary: `summary.md` among this run's artifacts)"
        tracker.describe(tracker.parent_id, head + rest)
        tracker.log_artifact(md)
        tracker.log_artifact(js)
        out.print(f"report: {md}, {js.name}", markup=False)
        out.print(conclusion.line, markup=False)
        code = conclusion.exit_code
    save_tuned(study, today)
    runs = tuned_runs(study)
    for path in write_history(study_dir, runs, f"{settings.study.name}: recommended, run by run"):
        tracker.log_artifact(path)
    return code


def _regime_lines(diagnoses: Mapping[int, Diagnosis], best: TrialRecord | None) -> list[str]:
    """How many measured configurations were in each regime, and why the recommendation is in
    its own."""
    if not diagnoses:
        return []
    regimes = [d.regime for d in diagnoses.values()]
    lines = [
        "regimes: "
        + ", ".join(f"{regimes.count(r)} {r}" for r in dict.fromkeys(sorted(regimes)))
        + " (docs/method/why-fast.md)"
    ]
    if best is not None and best.number in diagnoses:
        d = diagnoses[best.number]
        lines.append(
            f"  the recommendation #{best.number} is {d.regime}: {d.why}; MFU {d.mfu:.1%} "
            f"({si(d.achieved_flops)}FLOP/s)"
        )
    return lines


def _print_front(
    ctx: Context,
    front: list[TrialRecord],
    best: TrialRecord | None,
    unit: str,
    diagnoses: Mapping[int, Diagnosis],
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
                diagnoses,
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
