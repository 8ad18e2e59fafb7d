"""What a person reads: a line per trial, the Pareto table, and the files kept after a study.

Files written to ``<runs_dir>/<study>/``: ``pareto.csv`` (stable Pareto configurations),
``pareto.png`` (throughput against latency p95 for every measured configuration), and
``best.yaml`` (the recommended configuration).
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from search.analysis.diagnosis import Diagnosis
from search.analysis.noise_floor import NoiseFloor
from search.core.metrics import METRICS
from search.core.records import (
    COMPLETE,
    FAILED,
    FAULT_KINDS,
    INFEASIBLE,
    TrialRecord,
    config_name,
    fault_kind,
    si,
    value_text,
)
from search.reporting.study_result import StudyResult
from search.reporting.walls import predicted_text
from search.space.search_space import SearchSpace

__all__ = [
    "DESCRIPTION_CHARS",
    "Columns",
    "StudyProgress",
    "console",
    "front_cells",
    "knobs_text",
    "pareto_table",
    "plot_groups",
    "shown_metrics",
    "summary_lines",
    "summary_markdown",
    "throughput_text",
    "trial_line",
    "write_best",
    "write_csv",
    "write_noise_plot",
    "write_plot",
]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def shown_metrics(objectives: Sequence[str]) -> list[str]:
    """The figures beside throughput: every other objective first, then p95 latency and memory."""
    return list(
        dict.fromkeys(
            [m for m in objectives if m != "throughput"] + ["latency_p95_ms", "peak_memory_mb"]
        )
    )


@dataclass(frozen=True)
class Columns:
    """What a trial line and the front's table show of each configuration: its knobs by name,
    throughput with its interval at ``confidence``, the figures beside it (``shown_metrics``),
    and the unit throughput counts in the table's header (a trial line takes its record's)."""

    knob_names: Sequence[str]
    confidence: float
    shown: Sequence[str] = ()
    unit: str = "items"

    @classmethod
    def of(cls, space: SearchSpace, confidence: float, unit: str = "items") -> Columns:
        """The columns of ``space``: its searched knobs, and the figures beside throughput for
        its objectives."""
        shown = shown_metrics([o.metric for o in space.objectives])
        return cls(list(space.searched), confidence, shown, unit)


@dataclass(frozen=True)
class StudyProgress:
    """Where an invocation's study stands as a trial ends: trials measured so far of the
    ``total`` it measures, the size of the stable front, and the time since it started, s."""

    done: int
    total: int
    front_size: int
    elapsed_s: float


def _figure(metrics: Mapping[str, float], name: str) -> str:
    """A registered metric's value as the terminal shows it (``nan`` where it was not measured)."""
    return f"{metrics.get(name, math.nan):{METRICS[name].fmt}}"


def knobs_text(config: Mapping[str, Any], names: Sequence[str]) -> str:
    return " ".join(f"{k}={value_text(config[k])}" for k in names) or "fixed knobs only"


def throughput_text(metrics: Mapping[str, float], unit: str) -> str:
    low, high = metrics["throughput_ci_low"], metrics["throughput_ci_high"]
    return f"{si(metrics['throughput'])} {unit}/s [{si(low)}, {si(high)}]"


def trial_line(
    record: TrialRecord,
    progress: StudyProgress,
    columns: Columns,
    diagnosis: Diagnosis | None = None,
) -> str:
    """``[3/10] #4 batch_size=8 ... -> 41.2k tokens/s [40.1k, 42.3k] ..., stable, mfu 31%
    compute-bound | front 2 | 0:42, ETA 1:30``."""
    done, total, elapsed_s = progress.done, progress.total, progress.elapsed_s
    knobs = knobs_text(record.config, columns.knob_names)
    why = f" ({record.why})" if record.why else ""
    head = f"[{done}/{total}] #{record.number} {knobs}{why} -> "
    if record.state == COMPLETE:
        m = record.metrics
        figures = ", ".join(
            f"{METRICS[k].label} {_figure(m, k)} {METRICS[k].unit}" for k in columns.shown
        )
        verdict = "stable" if record.stable else f"UNSTABLE ({record.reason.split(':', 1)[0]})"
        if record.screened:
            verdict += ", screened: out of the front's reach"
        body = (
            f"{throughput_text(m, record.unit)} ({columns.confidence:.0%} CI, "
            f"{m['n_windows']:.0f} windows, {m['n_steps']:.0f} steps) "
            f"cv {m['throughput_cv']:.1%}, {figures}, {verdict}"
            + (f", mfu {diagnosis.mfu_text()} {diagnosis.regime}" if diagnosis is not None else "")
            + "".join(note(m) for note in (_again_text, _compiled_text, predicted_text))
        )
    else:
        body = f"{record.state.upper()}: {record.failure}"
    eta_s = elapsed_s / done * (total - done)
    return (
        f"{head}{body} | front {progress.front_size} | {_clock(elapsed_s)} elapsed, "
        f"ETA {_clock(eta_s)}"
    )


def _again_text(m: Mapping[str, float]) -> str:
    """A run measured again for its window dispersion: the second process's window CV."""
    cv = m.get("dispersed_again_cv")
    return "" if cv is None else f", measured again for its dispersion: cv {cv:.1%} there"


def _compiled_text(m: Mapping[str, float]) -> str:
    """A compiled trial's compile time (cold or warm cache), in its second process too with the
    spread of the two processes' throughputs, and its error against eager fp32, which the
    fidelity check passed ('' for an eager trial)."""
    if "compile_time_s" not in m:
        return ""
    cache = "warm" if m["compile_cache_warm"] else "cold"
    text = f", compiled in {m['compile_time_s']:.1f} s ({cache})"
    if "compile_between_process_cv" in m:
        text += (
            f", {m['compile_time_warm_s']:.1f} s in a second process, the two "
            f"{m['compile_between_process_cv']:.1%} apart (CV)"
        )
    elif m.get("compile_second_skipped"):
        text += ", no second process (out of reach of the front: a second could not change it)"
    errors = ("fidelity_loss_rel_error", "fidelity_logits_rel_error")
    error = next((m[k] for k in errors if k in m), None)
    return text + (f", fidelity ok ({error:.1g} off eager fp32)" if error is not None else "")


def summary_lines(
    outcome,
    history: Sequence[TrialRecord],
    recovered: Sequence[str] = (),
    *,
    noise_line: str = "",
    passed_over: Sequence[str] = (),
) -> list[str]:
    """How the invocation went: what was measured, rejected, reused or skipped, why it stopped,
    every fault by kind (oom, crash, timeout, error) with the trials it hit, how many measured
    configurations were unstable and why, the machine's noise (``noise_line``), and why each
    configuration surely faster than the recommendation was passed over (``passed_over``)."""
    states = [r.state for r in outcome.records]
    counts = ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states))) or "none"
    lines = [
        f"\nthis run: {len(outcome.records)} measured ({counts}); "
        f"proposals that broke a constraint: {outcome.rejected}, "
        f"that repeated an earlier measurement (reused, not re-run): {outcome.reused}, "
        f"certain to run out of memory (not run): {outcome.skipped_oom}"
        + (
            f", measured by another process at the time: {outcome.in_flight}"
            if outcome.in_flight
            else ""
        )
        + f"; stopped by {outcome.stop_reason}. Study total: {len(history)} measured."
    ]
    lines += [f"recovered: {note}" for note in recovered]
    if outcome.lost_to_recovery:
        lines.append(
            f"trial(s) {', '.join(f'#{n}' for n in outcome.lost_to_recovery)} were taken for stale "
            "by another process while measured here (heartbeat silent past the grace period; "
            "raise study.heartbeat_s on a busy store): queued again and measured anew"
        )
    lines += [f"dropped: {note}" for note in outcome.dropped]
    lines += _fault_lines(outcome.records)
    unstable = [r for r in history if r.state == COMPLETE and not r.stable]
    if unstable:
        lines.append(
            f"{len(unstable)} measured configuration(s) were unstable and are left off the front:"
        )
        lines += [f"  #{r.number} {r.reason}" for r in unstable]
    if noise_line:
        lines.append(noise_line)
    lines += passed_over
    return lines


def _fault_lines(records: Sequence[TrialRecord]) -> list[str]:
    """This invocation's faults by kind with the trials they hit, its infeasible trials, and the
    trials racing screened."""
    lines: list[str] = []
    failed = [r for r in records if r.state == FAILED]
    if failed:
        kinds = [fault_kind(r.failure) or "other" for r in failed]
        lines.append(
            "faults: "
            + ", ".join(f"{kinds.count(k)} {k}" for k in (*FAULT_KINDS, "other") if k in kinds)
        )
        lines += [f"  #{r.number} {r.failure}" for r in failed]
    infeasible = [r for r in records if r.state == INFEASIBLE]
    lines += [f"  #{r.number} infeasible: {r.failure}" for r in infeasible]
    screened = [r for r in records if r.state == COMPLETE and r.screened]
    if screened:
        windows = sorted(int(r.metrics["n_windows"]) for r in screened)
        span = f"{windows[0]}" + (f" to {windows[-1]}" if windows[-1] > windows[0] else "")
        lines.append(
            f"screened: {', '.join(f'#{r.number}' for r in screened)} stopped after {span} "
            "windows, their best case dominated by the front (measure.race; their figures are "
            "kept, with wider intervals)"
        )
    return lines


def front_cells(
    front: Sequence[TrialRecord],
    best: TrialRecord | None,
    columns: Columns,
    diagnoses: Mapping[int, Diagnosis],
) -> tuple[list[str], list[list[str]]]:
    """The front as the terminal and the parent run's description show it: the header and a row
    per configuration, fastest first (MFU and regime where ``diagnoses`` has any)."""
    knob_names, shown = columns.knob_names, columns.shown
    unit, confidence = columns.unit, columns.confidence
    header = [
        "trial",
        *knob_names,
        f"throughput ({unit}/s, {confidence:.0%} CI)",
        "cv",
        *(f"{METRICS[k].label} {METRICS[k].unit}" for k in shown),
        "windows",
        *(("mfu", "regime") if diagnoses else ()),
        "",
    ]
    rows = []
    for r in sorted(front, key=lambda r: -r.metrics["throughput"]):
        m = r.metrics
        rows.append(
            [
                str(r.number),
                *(value_text(r.config[k]) for k in knob_names),
                throughput_text(m, "").replace(" /s", ""),
                f"{m['throughput_cv']:.1%}",
                *(_figure(m, k) for k in shown),
                f"{m['n_windows']:.0f}",
                *(_diagnosis_cells(diagnoses.get(r.number)) if diagnoses else ()),
                "best" if best is not None and r.number == best.number else "",
            ]
        )
    return header, rows


def pareto_table(
    front: Sequence[TrialRecord],
    best: TrialRecord | None,
    columns: Columns,
    title: str,
    diagnoses: Mapping[int, Diagnosis] | None = None,
) -> Table:
    """The front, fastest first; with ``diagnoses`` (by trial number) its MFU and regime too."""
    header, rows = front_cells(front, best, columns, diagnoses or {})
    table = Table(title=title, title_justify="left")
    for column in header:
        table.add_column(column, justify="right" if column not in columns.knob_names else "left")
    for row in rows:
        table.add_row(*row)
    return table


def _diagnosis_cells(diagnosis: Diagnosis | None) -> tuple[str, str]:
    if diagnosis is None:
        return "-", "-"
    return diagnosis.mfu_text(why=False), diagnosis.regime


DESCRIPTION_CHARS = 8000
"""MLflow keeps at most this many characters of a tag (a run's description is one)."""


def summary_markdown(
    title: str,
    front_table: tuple[list[str], list[list[str]]],
    best: TrialRecord | None,
    columns: Columns,
    sections: Mapping[str, Sequence[str]],
    limit: int | None = DESCRIPTION_CHARS,
) -> str:
    """A study's summary as MLflow shows a parent run's description: the recommendation, the
    front as a table (``front_cells`` of the same ``columns``), then ``sections`` (heading: the
    lines the terminal printed); beyond ``limit`` characters the sections left are cut, with a
    note pointing to ``summary.md`` (the whole, written with ``limit=None``)."""
    lines = [f"### {title}", ""]
    if best is not None:
        lines.append(
            f"**Recommended: #{best.number} `{config_name(best.config)}`**, "
            f"{throughput_text(best.metrics, columns.unit)} ({columns.confidence:.0%} CI)"
        )
    else:
        lines.append("**Nothing recommended** (see below)")
    header, rows = front_table
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    note = "\n\n(more in `summary.md` among this run's artifacts)"
    text = "\n".join(lines)
    for heading, body in sections.items():
        block = "\n".join(["", "", f"#### {heading}", "", "```", *body, "```"]) if body else ""
        if limit is not None and len(text) + len(block) + len(note) > limit:
            return text + note
        text += block
    return text


def write_csv(path: Path, front: Sequence[TrialRecord], knob_names: Sequence[str]) -> None:
    metric_names = sorted({k for r in front for k in r.metrics})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "mlflow_run_id", *knob_names, *metric_names])
        for r in sorted(front, key=lambda r: -r.metrics["throughput"]):
            writer.writerow(
                [
                    r.number,
                    r.run_id or "",
                    *(r.config[k] for k in knob_names),
                    *(r.metrics.get(k, "") for k in metric_names),
                ]
            )


def write_plot(
    path: Path, result: StudyResult, x_metric: str, confidence: float, title: str
) -> None:
    """Throughput (with its interval) against ``x_metric``, the space's first minimised
    objective, for every measured configuration of ``result``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, front, best = result.records, result.front, result.best
    style = {
        "unstable": ("tab:gray", "x"),
        "stable": ("tab:blue", "o"),
        "Pareto-optimal, stable": ("tab:red", "o"),
    }
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, rows in plot_groups(history, front):
        color, marker = style[label]
        if not rows:
            continue
        x = [r.metrics.get(x_metric, math.nan) for r in rows]
        y = [r.metrics["throughput"] for r in rows]
        err = [
            [r.metrics["throughput"] - r.metrics["throughput_ci_low"] for r in rows],
            [r.metrics["throughput_ci_high"] - r.metrics["throughput"] for r in rows],
        ]
        ax.errorbar(x, y, yerr=err, fmt=marker, color=color, label=label, capsize=3, alpha=0.85)
        if label.startswith("Pareto"):
            for r, xi, yi in zip(rows, x, y, strict=True):
                ax.annotate(
                    f"#{r.number}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
    if best is not None:
        ax.plot(
            [best.metrics.get(x_metric, math.nan)],
            [best.metrics["throughput"]],
            marker="*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label=f"recommended (#{best.number})",
        )
    ax.set_xlabel(x_metric)
    unit = history[0].unit if history else "items"
    ax.set_ylabel(f"throughput ({unit}/s), {confidence:.0%} CI")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_groups(
    history: Sequence[TrialRecord], front: Sequence[TrialRecord]
) -> list[tuple[str, list[TrialRecord]]]:
    """The complete configurations of ``history`` as ``pareto.png`` draws them: unstable, stable,
    Pareto-optimal. Pass the records with their final verdicts
    (``search.revalidation.candidates.with_revalidation``)."""
    on_front = {r.number for r in front}
    done = [r for r in history if r.state == COMPLETE]
    return [
        ("unstable", [r for r in done if not r.stable and r.number not in on_front]),
        ("stable", [r for r in done if r.stable and r.number not in on_front]),
        ("Pareto-optimal, stable", [r for r in done if r.number in on_front]),
    ]


def write_noise_plot(path: Path, floor: NoiseFloor, title: str, unit: str = "items") -> None:
    """The control's throughput over the study (each run with its window CV as an error bar) and,
    where drift was significant, the fitted line the figures were corrected with."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    session = floor.session
    t0 = session[0].time_s
    minutes = [(c.time_s - t0) / 60 for c in session]
    level = [c.throughput for c in session]
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    ax.errorbar(
        minutes,
        level,
        yerr=[c.cv * c.throughput for c in session],
        fmt="o",
        capsize=3,
        label="control run (bar: window CV)",
    )
    mean = float(np.exp(np.mean(np.log(level))))
    if floor.corrected:
        fitted = [mean * floor.level(c.time_s, c.device)[0] for c in session]
        ax.plot(minutes, fitted, "r--", label=f"drift {floor.drift:+.1%}, corrected")
    ax.axhline(mean, color="gray", lw=0.8, label="geometric mean")
    ax.set_xlabel("minutes since this session's first control run")
    ax.set_ylabel(f"control throughput ({unit}/s)")
    ax.set_title(
        f"{title}\nbetween-run CV {floor.between_cv:.1%} ({floor.between_df} df), "
        f"within-run {floor.within_cv:.1%}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_best(path: Path, best: TrialRecord | None, context: Mapping[str, Any]) -> None:
    if best is None:
        payload: dict[str, Any] = {"recommended": None, **context}
    else:
        payload = {
            "recommended": {
                "trial": best.number,
                "mlflow_run_id": best.run_id,
                "config": dict(best.config),
            },
            "metrics": {k: float(v) for k, v in best.metrics.items()},
            "throughput_unit": f"{best.unit}/s",
            **context,
        }
    path.write_text(yaml.safe_dump(payload, sort_keys=False))


def console() -> Console:
    # Logs and CI capture output without a terminal: rich would wrap those at 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
