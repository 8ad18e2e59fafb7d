"""The end of a study: its front after re-validation, and what it found, written to files, logged
on MLflow and printed as the summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from search.analysis.diagnosis import Diagnosis, doubling
from search.analysis.noise_floor import NoiseFloor
from search.analysis.pareto import closest_to_slo
from search.commands.context import Context
from search.commands.invocation import sync_command
from search.commands.revalidation_rounds import revalidate_front
from search.config.compose import redact
from search.config.prepare import workload_class
from search.core.records import COMPLETE, TrialRecord
from search.reporting import results
from search.reporting.compiled import compile_lines
from search.reporting.oracle import oracle, oracle_lines, oracle_values, write_oracle_plot
from search.reporting.report import (
    Columns,
    front_cells,
    pareto_table,
    shown_metrics,
    si,
    summary_lines,
    summary_markdown,
    write_noise_plot,
)
from search.reporting.study_result import StudyResult
from search.reporting.trainer_words import (
    HF_TRAINER_FILE,
    LIGHTNING_FILE,
    hf_trainer_line,
    write_trainer_files,
)
from search.reporting.walls import memory_walls, prediction_lines, wall_lines
from search.revalidation import candidates
from search.revalidation.pooling import Pooled
from search.storage.repeat_runs import judged_revalidations
from search.study.driver import StudyDriver
from search.study.late_checks import dispersed_at_the_end
from search.study.outcome import StudyOutcome
from search.tracking.tracker import Tracker

__all__ = ["Finished", "finish"]


@dataclass(frozen=True, kw_only=True)
class Finished:
    """What a study ended with."""

    front: list[TrialRecord]
    best: TrialRecord | None
    records: list[TrialRecord]
    """Every measured trial with its final figures (``StudyResult.records``)."""
    floor: NoiseFloor
    unit: str
    description: str = ""
    """The parent run's description (markdown): the summary."""


def finish(ctx: Context, driver: StudyDriver, outcome: StudyOutcome, tracker: Tracker) -> Finished:
    """Re-validate the front and take the last control runs, then write, log and print what the
    study found: its front and recommendation, the machine's noise, the regimes and the oracle."""
    settings, space = ctx.settings, ctx.space
    revalidate_front(ctx, driver)
    driver.run_control()  # the end of the study: drift needs both ends
    _dispersed_at_the_end(ctx, driver, outcome)
    floor = driver.floor()
    history = driver.history()
    found = _study_result(ctx, driver, floor, history)
    front, best, done, final = found.front, found.best, found.revalidated, found.records
    if settings.revalidate.processes and done:
        _print_revalidated(ctx, history, front, done)
    results.mark_front(tracker, outcome.study_name, front)
    study_dir = Path(settings.runs_dir) / outcome.study_name
    _write_files(ctx, tracker, study_dir, found)
    mine = {r.number for r in outcome.records}
    ours = [r for r in history if r.number in mine]
    _log_final(ctx, tracker, found, study_dir, driver.control_s, ours)
    if best is not None:
        tracker.set_tags(tracker.parent_id, {"best_trial": str(best.number)})
        tracker.log_metrics(tracker.parent_id, {f"best_{k}": v for k, v in best.metrics.items()})
    noise = _noise_lines(driver, floor, settings.measure.confidence)
    out = ctx.out
    for line in summary_lines(
        outcome,
        history,
        driver.recovery.notes if driver.recovery else (),
        noise_line="\n".join(noise),
        passed_over=results.passed_over(history, front, best, done, settings.slo, space),
    ):
        out.print(line, markup=False)
    unit = found.unit
    _print_front(ctx, found)
    _print_trainer_line(ctx, best)
    regimes = _regime_lines(found.diagnoses, best, ctx.peak.source if ctx.peak else None)
    compiling = compile_lines(final, best, done, floor)
    walls = wall_lines(memory_walls(history)) + prediction_lines(ours)
    for line in regimes + compiling + walls:
        out.print(line, markup=False)
    oracle_text = _print_oracle(ctx, tracker, final, unit, study_dir)
    sections = {
        "The machine's noise": noise,
        "Regimes": regimes,
        "Compilation": compiling,
        "Memory wall": walls,
        "Oracle": oracle_text,
    }
    title = f"{outcome.study_name} on {ctx.env['device_name']}"
    description = _write_summary(ctx, tracker, study_dir, title, found, sections)
    _print_where(ctx, tracker, study_dir, outcome.study_name, floor)
    return Finished(
        front=front,
        best=best,
        records=final,
        floor=floor,
        unit=unit,
        description=description,
    )


def _dispersed_at_the_end(ctx: Context, driver: StudyDriver, outcome: StudyOutcome) -> None:
    """Measure again the trials of this invocation that the final floor calls dispersed, and say
    so (``search.study.late_checks``)."""
    again = dispersed_at_the_end(driver, {r.number for r in outcome.records})
    if again:
        numbers = ", ".join(f"#{n}" for n in again)
        ctx.out.print(
            f"measured again in a fresh process, for their window dispersion against the final "
            f"noise floor: trial(s) {numbers}",
            markup=False,
        )


def _study_result(
    ctx: Context, driver: StudyDriver, floor: NoiseFloor, history: list[TrialRecord]
) -> StudyResult:
    """What the study found on ``floor``: the front after re-validation, the recommendation, and
    every trial with its final figures, verdict and regime."""
    settings = ctx.settings
    done = judged_revalidations(driver.study, ctx.fingerprint, settings)
    front = candidates.final_front(history, done, settings, ctx.space)
    final = candidates.with_revalidation(history, done)  # every file shows the final verdicts
    return StudyResult(
        records=final,
        front=front,
        best=results.recommend(front, settings.slo),
        unit=history[0].unit if history else "items",
        floor=floor,
        revalidated=done,
        diagnoses={r.number: d for r in final if (d := ctx.diagnosis(r, final)) is not None},
    )


def _print_revalidated(
    ctx: Context,
    history: list[TrialRecord],
    front: list[TrialRecord],
    done: Mapping[int, Pooled],
) -> None:
    """How many re-validated configurations stayed on the front, and which left it."""
    out = ctx.out
    dropped = candidates.left_the_front(history, front, done)
    twins = sorted(candidates.revalidated_twins(history, done) - {r.number for r in front})
    judged = len(done) - len(twins)
    out.print(
        f"re-validation: {judged - len(dropped)} of {judged} re-validated "
        "configuration(s) on the front"
        + (f"; not on it: {', '.join(dropped)}" if dropped else "")
        + (
            f"; re-validated for the compile comparison: {', '.join(f'#{n}' for n in twins)} "
            "(uncompiled)"
            if twins
            else ""
        )
    )


def _write_files(ctx: Context, tracker: Tracker, study_dir: Path, found: StudyResult) -> None:
    """The study's files (``results.write_files``), logged as artifacts of the parent run."""

    def diagnosed(r: TrialRecord) -> TrialRecord:  # the files carry the diagnosis's figures
        d = found.diagnoses.get(r.number)
        return r if d is None else replace(r, metrics={**r.metrics, **d.metrics()})

    best = found.best
    with_figures = replace(
        found,
        front=[diagnosed(r) for r in found.front],
        best=diagnosed(best) if best is not None else None,
    )
    device_name = ctx.env["device_name"]
    for path in results.write_files(study_dir, with_figures, ctx.settings, ctx.space, device_name):
        tracker.log_artifact(path)
    for path in write_trainer_files(study_dir, _trained(ctx, best)):
        tracker.log_artifact(path)


def _print_trainer_line(ctx: Context, best: TrialRecord | None) -> None:
    """The recommendation as the HF Trainer's arguments, where the workload is a transformers
    model (one that needs transformers)."""
    trained = _trained(ctx, best)
    if trained is not None and "transformers" in getattr(workload_class(ctx.space), "requires", {}):
        ctx.out.print(f"  for the HF Trainer: {hf_trainer_line(trained)}", markup=False)


def _trained(ctx: Context, best: TrialRecord | None) -> dict[str, Any] | None:
    """The recommendation's configuration where the workload trains (a trainer's arguments say
    nothing of serving); else None."""
    training = getattr(workload_class(ctx.space), "task", "train") == "train"
    return dict(best.config) if best is not None and training else None


def _paired(final: Sequence[TrialRecord], mine: set[int]) -> list[TrialRecord]:
    """Earlier trials whose batch-doubling pair is one of this invocation's trials ``mine``."""
    return [
        r
        for r in final
        if r.number not in mine and (pair := doubling(r, final)) is not None and pair[0] in mine
    ]


def _log_final(
    ctx: Context,
    tracker: Tracker,
    found: StudyResult,
    study_dir: Path,
    control_s: float,
    mine: list[TrialRecord],
) -> None:
    """The figures as the final noise floor gives them, on MLflow: the floor and the control's
    level over time on the parent run (with ``noise.png``); the intervals spanning runs, the
    verdict, the re-validated figures and the regime (with the study's batch-doubling pairs) on
    the runs of this invocation's trials ``mine`` (a later step of the same metrics), and the
    regime on earlier trials paired with one of them."""
    floor, done, diagnoses = found.floor, found.revalidated, found.diagnoses
    paired = _paired(found.records, {r.number for r in mine})
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
            ] + ["dispersed_again_cv"]  # measured again at the end: known at step 1 only
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
            tracker.set_tags(record.run_id, diagnosis.tags())


def _noise_lines(driver: StudyDriver, floor: NoiseFloor, confidence: float) -> list[str]:
    """The machine's noise: the final floor, and the share of this invocation the control runs
    took."""
    return results.noise_lines(floor, confidence) + (
        [
            f"  the control runs of this invocation took {driver.control_s:.0f} s, "
            f"{driver.control_s / driver.elapsed_s():.0%} of its {driver.elapsed_s():.0f} s"
        ]
        if driver.control_runs
        else []
    )


def _print_oracle(
    ctx: Context, tracker: Tracker, final: list[TrialRecord], unit: str, study_dir: Path
) -> list[str]:
    """The best stable figure at each value of each knob, printed and plotted (``oracle.png``):
    its lines."""
    settings, space, out = ctx.settings, ctx.space, ctx.out
    rows = oracle(final, {k: oracle_values(p) for k, p in space.searched.items()}, settings.slo)
    shown = shown_metrics([o.metric for o in space.objectives])
    # No knob searched (every one fixed): there is no per-value view to print.
    oracle_text = (
        oracle_lines(rows, list(space.searched), unit, shown[:2]) if space.searched else []
    )
    for line in oracle_text:
        out.print(line, markup=False)
    if rows:
        write_oracle_plot(
            study_dir / "oracle.png",
            rows,
            unit,
            f"{space.name} on {ctx.env['device_name']}: best stable throughput at each value",
        )
        tracker.log_artifact(study_dir / "oracle.png")
    return oracle_text


def _write_summary(
    ctx: Context,
    tracker: Tracker,
    study_dir: Path,
    title: str,
    found: StudyResult,
    sections: Mapping[str, list[str]],
) -> str:
    """``summary.md`` (an artifact) and the parent run's description: the description."""
    columns = Columns.of(ctx.space, ctx.settings.measure.confidence, found.unit)
    cells = front_cells(found.front, found.best, columns, found.diagnoses)
    summary = study_dir / "summary.md"
    summary.write_text(summary_markdown(title, cells, found.best, columns, sections, None))
    tracker.log_artifact(summary)
    description = summary_markdown(title, cells, found.best, columns, sections)
    tracker.describe(tracker.parent_id, description)
    return description


def _print_where(
    ctx: Context, tracker: Tracker, study_dir: Path, study_name: str, floor: NoiseFloor
) -> None:
    """Where the files are, and how to compare the runs on MLflow (or copy them there later)."""
    out = ctx.out
    noise_png = ", noise.png" if floor.controls else ""
    # history.* follow from the conclusion, before the command ends
    trainer = (
        f", {HF_TRAINER_FILE}, {LIGHTNING_FILE}" if (study_dir / HF_TRAINER_FILE).exists() else ""
    )
    out.print(
        f"files: {study_dir}/best.yaml{trainer}, summary.md, pareto.csv, pareto.png, oracle.png"
        f"{noise_png}, history.csv, history.png"
    )
    if tracker.offline_reason or tracker.log_error:
        out.print(
            f"MLflow: {tracker.offline_reason or tracker.log_error}. {tracker.unlogged_trials} "
            "trial(s) of this run are in the Optuna study only; when MLflow works again, copy "
            f"them with: {sync_command()}",
            markup=False,
        )
    else:
        out.print(f"compare runs in the MLflow UI: [bold]{redact(tracker.ui_command())}[/]")
        url = tracker.ui_url(study_name)
        if url:
            out.print(f"  the front, compared: {url}", markup=False)


def _regime_lines(
    diagnoses: Mapping[int, Diagnosis], best: TrialRecord | None, peak_source: str | None
) -> list[str]:
    """How many measured configurations were in each regime, and why the recommendation is in
    its own, with where the peak its MFU divides by comes from (how and when it was measured)."""
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
        mfu = d.mfu_text(why=not d.peak_under_load)  # the peak's source says it was under load
        lines.append(
            f"  the recommendation #{best.number} is {d.regime}: {d.why}; MFU {mfu} "
            f"({si(d.achieved_flops)}FLOP/s)" + (f" of a peak {peak_source}" if peak_source else "")
        )
    return lines


def _whose_figures(front: Sequence[TrialRecord], pooled: Mapping[int, Pooled]) -> str:
    """Where the front's figures come from: fresh processes pooled (re-validation, or a re-tune's
    baseline re-measured), the search's own runs, or some of each."""
    counts = sorted({len(pooled[r.number].runs) for r in front if r.number in pooled})
    if not counts:
        return " (search-time figures)"
    n = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    many = sum(r.number in pooled for r in front)
    if many == len(front):
        return f" (figures pooled from {n} fresh processes each)"
    return (
        f" ({many} of {len(front)} with figures pooled from {n} fresh processes each, the rest "
        "search-time figures)"
    )


def _print_front(ctx: Context, found: StudyResult) -> None:
    out = ctx.out
    front, best = found.front, found.best
    if front:
        title = "Pareto-optimal stable configurations" + _whose_figures(front, found.revalidated)
        columns = Columns.of(ctx.space, ctx.settings.measure.confidence, found.unit)
        out.print(pareto_table(front, best, columns, title, found.diagnoses))
    else:
        out.print(
            "[yellow]no stable configuration yet[/]: nothing is on the front; "
            "see the trial lines above"
        )
    if best is None and front:
        closest = closest_to_slo([r.metrics for r in front], ctx.settings.slo)
        out.print(
            f"[yellow]no Pareto configuration meets the slo[/] ({closest}); best.yaml records "
            "none: loosen the slo, or widen the space toward it",
            highlight=False,
        )
