"""The conclusion of a tuning or a re-tune: the recommendation confirmed in fresh runs, kept in
the study as this run's record, and for a re-tune compared with the baseline's."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import optuna
import yaml

from search.commands.context import Context
from search.commands.finish import Finished
from search.core.records import COMPLETE, TrialRecord
from search.execution.trial import TrialResult
from search.reporting import results
from search.reporting.report import DESCRIPTION_CHARS, knobs_text, si
from search.reporting.trainer_words import HF_TRAINER_FILE, write_trainer_files
from search.retuning.comparison import MIN_RUNS, Comparison
from search.retuning.confirm import confirm
from search.retuning.figure import Figure
from search.retuning.retune_report import write_report
from search.retuning.tuned import RETUNE, TUNE, Tuned, save_tuned, tuned_runs
from search.retuning.tuning_history import write_history
from search.retuning.verdict import MOVED, Conclusion, conclude, held_back
from search.revalidation.pooling import FreshRuns
from search.tracking.tracker import Tracker

__all__ = ["conclude_tuning"]


def conclude_tuning(
    ctx: Context, study: optuna.Study, tracker: Tracker, base: Tuned | None, finished: Finished
) -> int:
    """Confirm the recommendation and keep what this run concluded in the study; for a re-tune,
    compare with the baseline, report and return the exit code (3 on a regression)."""
    settings, out = ctx.settings, ctx.out
    best = finished.best
    old = base.recommended if base is not None else None
    started = time.monotonic()
    confirmed, old_today, kept = (
        _confirm(ctx, tracker, finished, old) if best is not None else (None, None, None)
    )
    ctx.spent.confirmation_s += time.monotonic() - started
    # before a re-tune's verdict, which stays the last line (scripts read it)
    out.print(ctx.spent.line(), markup=False)
    tracker.log_metrics(tracker.parent_id, ctx.spent.metrics())
    today = _today(ctx, tracker, base, finished, confirmed)
    # the name history, best.yaml's baseline and retune.baseline know this run by
    tracker.set_tags(tracker.parent_id, {"recorded_as": today.name})
    code = 0
    if base is not None:
        today, code = _compare(ctx, tracker, base, today, (old_today, kept), finished)
    _amend_best_yaml(ctx, tracker, today.recommended, finished, kept)
    if kept is not None and today.recommended is not None:
        _amend_summary(ctx, tracker, today.recommended, kept)
    title = f"{settings.study.name}: recommended, run by run"
    for path in write_history(ctx.study_dir(), [*tuned_runs(study), today], title):
        tracker.log_artifact(path)
    # last: once the record is in the study, a re-run takes it as done (a re-tune's baseline)
    save_tuned(study, today)
    return code


def _amend_summary(ctx: Context, tracker: Tracker, kept: Figure, why: Comparison) -> None:
    """``summary.md`` (written before the confirmation named the search's best) says which
    configuration stayed recommended, and why."""
    path = ctx.study_dir() / "summary.md"
    if not path.exists():
        return
    knobs = knobs_text(kept.config, list(ctx.space.searched))
    path.write_text(
        path.read_text().rstrip("\n")
        + f"\n\n## Kept\n\nThe old recommendation #{kept.trial} ({knobs}) stays recommended: the "
        f"search's best read {why.ratio:.3f}x [{why.low:.3f}, {why.high:.3f}] of it in the same "
        "confirmation rounds, not surely faster by more than retune.threshold.\n"
    )
    tracker.log_artifact(path)


def _confirm(
    ctx: Context, tracker: Tracker, finished: Finished, old: Figure | None
) -> tuple[Figure | None, Figure | None, Comparison | None]:
    """The recommendation confirmed in ``retune.confirm`` rounds of fresh runs after it was
    chosen, each round a run of the reference step and then the recommendation (and the old
    recommendation ``old`` of a re-tune, where it is another configuration still in the space):
    their confirmed figures (``search.retuning.confirm.confirm``), None where confirmation is off or
    too many runs failed; and where the old recommendation stays (``held_back``), its figure
    first and the comparison that kept it."""
    settings, out = ctx.settings, ctx.out
    best, unit = finished.best, finished.unit
    assert best is not None
    rounds = settings.retune.confirm
    if rounds == 0:
        return None, None, None
    other = (
        old.config
        if old is not None and old.config != best.config and ctx.space.contains(old.config)
        else None
    )
    configs = [best.config] + ([other] if other is not None else [])
    _announce(ctx, best, other, rounds)
    confirmed = confirm(
        configs,
        ctx.repeat,
        str(ctx.device),
        FreshRuns(rounds, settings.seed + best.number, settings.measure.confidence),
        _confirm_progress(ctx, unit),
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
        return None, old_today, None
    figure = replace(figure, trial=best.number)
    qualifies = _qualifying(ctx, finished, old_today.config) if old_today is not None else None
    kept = (
        held_back(figure, old_today, settings.retune.threshold, settings.measure.confidence)
        if qualifies is not None
        else None
    )
    if kept is not None:
        assert old_today is not None and qualifies is not None
        figure = old_today = replace(old_today, trial=qualifies.number)
        _say_kept(ctx, tracker, kept, qualifies, best)
    _report_confirmed(ctx, tracker, figure, unit)
    return figure, old_today, kept


def _qualifying(ctx: Context, finished: Finished, config: Mapping[str, Any]) -> TrialRecord | None:
    """The latest trial of ``config`` if it could be recommended today as it was measured today:
    complete, stable and within the slo (the old recommendation is kept only then); else None."""
    records = [r for r in finished.records if r.config == config and r.state == COMPLETE]
    latest = max(records, key=lambda r: r.number, default=None)
    if latest is None or not latest.stable:
        return None
    return latest if results.recommend([latest], ctx.settings.slo) is latest else None


def _say_kept(
    ctx: Context, tracker: Tracker, kept: Comparison, old: TrialRecord, best: TrialRecord
) -> None:
    """Why the old recommendation stays: today's best is not surely faster by the threshold; the
    parent run's recommendation tags and figures are the old one's."""
    threshold = ctx.settings.retune.threshold
    ctx.out.print(
        f"kept the old recommendation #{old.number} "
        f"({knobs_text(old.config, list(ctx.space.searched))}): the search's best #{best.number} "
        f"read {kept.ratio:.3f}x [{kept.low:.3f}, {kept.high:.3f}] of it in the same rounds, not "
        f"surely more than {threshold:.0%} faster (retune.threshold); a recommendation moves only "
        "when the optimum surely moved",
        markup=False,
    )
    tracker.set_tags(
        tracker.parent_id, {"best_trial": str(old.number), "kept_over_trial": str(best.number)}
    )
    # A figure the search's best had and the kept one has not is no longer the recommendation's:
    # NaN, as MLflow keeps a metric's last value and deletes none (issue 65, defect 7).
    cleared = {f"best_{k}": math.nan for k in best.metrics if k not in old.metrics}
    figures = {f"best_{k}": v for k, v in old.metrics.items()}
    tracker.log_metrics(tracker.parent_id, {**cleared, **figures})


def _announce(
    ctx: Context, best: TrialRecord, other: Mapping[str, Any] | None, rounds: int
) -> None:
    """What the confirmation measures: the recommendation, the old one beside it where given, and
    the reference step."""
    settings, out = ctx.settings, ctx.out
    knobs = list(ctx.space.searched)
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


def _shown(result: TrialResult | None, what_unit: str) -> str:
    """A run's throughput in one cell, or why it has none."""
    if result is None or result.measurement is None:
        return f"{getattr(result, 'state', 'not run')}: {getattr(result, 'failure', '')}"
    return f"{si(result.measurement.throughput)} {what_unit}/s"


def _confirm_progress(
    ctx: Context, unit: str
) -> Callable[[int, int, TrialResult | None, list[TrialResult]], None]:
    """Print each confirmation round's figures as it ends."""
    out = ctx.out

    def progress(i: int, n: int, ref: TrialResult | None, results: list[TrialResult]) -> None:
        out.print(
            f"  [confirm {i}/{n}] "
            + "; ".join(
                f"{who} {_shown(r, unit)}"
                for who, r in zip(("recommendation", "old one"), results, strict=False)
            )
            + (f"; reference step {_shown(ref, 'tokens')}" if ref is not None else ""),
            markup=False,
        )

    return progress


def _report_confirmed(ctx: Context, tracker: Tracker, figure: Figure, unit: str) -> None:
    """The confirmed figure (and the reference step's), printed and logged on the parent run."""
    out = ctx.out
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


def _today(
    ctx: Context,
    tracker: Tracker,
    base: Tuned | None,
    finished: Finished,
    confirmed: Figure | None,
) -> Tuned:
    """This run's record: its recommendation (confirmed where it could be) and its front."""
    best = finished.best
    now = time.time()
    kind = TUNE if base is None else RETUNE
    return Tuned(
        kind=kind,
        name=f"{kind} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))}",
        time_s=now,
        fingerprint=ctx.fingerprint,
        env={k: str(v) for k, v in ctx.env.items()},
        device=ctx.env["device_name"],
        unit=finished.unit,
        recommended=(
            confirmed if confirmed is not None else (Figure.of(best) if best is not None else None)
        ),
        front=tuple(Figure.of(r) for r in finished.front),
        mlflow_run_id=tracker.parent_id,
    )


def _compare(
    ctx: Context,
    tracker: Tracker,
    base: Tuned,
    today: Tuned,
    old_today: tuple[Figure | None, Comparison | None],
    finished: Finished,
) -> tuple[Tuned, int]:
    """A re-tune's verdict against ``base``: printed (its line last), reported and described on
    the parent run; today's record with the verdict, and the exit code. ``old_today``: the old
    recommendation as measured today, and the comparison that kept it (``held_back``), if any."""
    settings, out = ctx.settings, ctx.out
    conclusion = conclude(
        base,
        today,
        old_today[0],
        settings.retune.threshold,
        settings.measure.confidence,
        kept=old_today[1],
    )
    today = replace(today, verdict=conclusion.verdict)
    _print_comparison(ctx, base, today, conclusion)
    md, js = write_report(ctx.study_dir(), base, today, conclusion, list(ctx.space.searched))
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
    return today, conclusion.exit_code


def _print_comparison(ctx: Context, base: Tuned, today: Tuned, conclusion: Conclusion) -> None:
    """The comparisons behind a re-tune's verdict, what changed, and both recommendations."""
    out = ctx.out
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


def _amend_best_yaml(
    ctx: Context,
    tracker: Tracker,
    recommended: Figure | None,
    finished: Finished,
    kept: Comparison | None,
) -> None:
    """``best.yaml`` with the recommendation's confirmed figure, and where the old recommendation
    was kept, that configuration and its trial in place of the search's best."""
    path = ctx.study_dir() / "best.yaml"
    if recommended is None or not recommended.runs or not path.exists():
        return
    payload = yaml.safe_load(path.read_text()) or {}
    if kept is not None:
        record = next((r for r in finished.records if r.number == recommended.trial), None)
        search_best = payload.get("recommended") or {}
        payload["recommended"] = {
            "trial": recommended.trial,
            "mlflow_run_id": record.run_id if record is not None else None,
            "config": dict(recommended.config),
        }
        payload["metrics"] = (
            {k: float(v) for k, v in record.metrics.items()} if record is not None else {}
        )
        payload["kept_over"] = {
            "trial": search_best.get("trial"),
            "config": search_best.get("config"),
            "ratio": kept.ratio,
            "ci_low": kept.low,
            "ci_high": kept.high,
            "why": "the search's best / the old recommendation, both measured in the same rounds: "
            "not surely faster by more than retune.threshold",
        }
    payload["confirmed"] = {
        "throughput": recommended.throughput,
        "ci_low": recommended.low,
        "ci_high": recommended.high,
        "fresh_runs": len(recommended.runs),
        "confidence": ctx.settings.measure.confidence,
    }
    path.write_text(yaml.safe_dump(payload, sort_keys=False))
    tracker.log_artifact(path)
    if kept is not None and (ctx.study_dir() / HF_TRAINER_FILE).exists():
        # the trainers' words follow the configuration kept, as best.yaml does
        for written in write_trainer_files(ctx.study_dir(), dict(recommended.config)):
            tracker.log_artifact(written)
