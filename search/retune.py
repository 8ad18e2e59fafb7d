"""Nightly re-tuning: did the model get slower, do the old best settings still hold, did the optimum
move?

Every tuning and re-tune ends by keeping what it concluded in the Optuna study (``Tuned``: its
recommendation and front with their intervals spanning runs, the workload and environment
fingerprints, and the reference step), so that the next re-tune finds its baseline there even
when MLflow is down. A re-tune (``search.app``) re-measures the baseline's recommendation and
front in fresh processes first, searches a little, and compares (``compare``, ``conclude``): each
comparison is a ratio today / baseline with an interval that holds the between-run uncertainty of
both sides.

The reference step is a fixed tiny training step of the built-in GPT, measured in fresh processes
in every run: it does not depend on the space's model, so a slower machine is not blamed on the
model.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
from scipy import stats

from search.config import ConfigError
from search.measure import MeasureSettings
from search.noise import NoiseFloor, assess_pooled
from search.records import TrialRecord
from search.revalidate import Pooled, pool
from search.runner import TrialRequest, run_isolated
from search.settings import StableSettings
from search.trial_store import retried

TUNED_PREFIX = "tuned:"
"""Study user attr ``tuned:<time>``: what one tuning or re-tune concluded (``Tuned``)."""

REFERENCE_WORKLOAD = {
    "_target_": "search.workloads.GPT",
    "vocab_size": 256,
    "seq_len": 32,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
}
"""The reference step's model: fixed, whatever the space."""
REFERENCE_CONFIG = {"batch_size": 8, "micro_batch_size": 8, "precision": "fp32"}
REFERENCE_MEASURE = MeasureSettings(
    warmup_steps=2, warmup_s=0.3, window_s=0.1, min_windows=5, max_windows=10, max_time_s=3.0
)

TUNE, RETUNE = "tune", "retune"
REGRESSION, MOVED, IMPROVED, SAME, AMBIGUOUS = (
    "regression",
    "moved",
    "improved",
    "same",
    "ambiguous",
)
EXIT_REGRESSION = 3


@dataclass(frozen=True)
class Figure:
    """A configuration's throughput with its interval (spanning runs; items/s)."""

    config: dict[str, Any]
    throughput: float
    low: float
    high: float
    trial: int | None = None

    @classmethod
    def of(cls, record: TrialRecord) -> Figure:
        m = record.metrics
        return cls(
            dict(record.config),
            float(m["throughput"]),
            float(m["throughput_ci_low"]),
            float(m["throughput_ci_high"]),
            record.number,
        )


@dataclass(frozen=True)
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
    front: tuple[Figure, ...] = ()
    reference: Figure | None = None
    """The reference step (items/s of the fixed tiny GPT)."""
    mlflow_run_id: str | None = None
    verdict: str = ""
    """A re-tune's overall verdict (``regression``, ``moved``, ...); '' for a tuning."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tuned:
        def figure(f: Mapping[str, Any] | None) -> Figure | None:
            return None if f is None else Figure(**f)

        return cls(
            **{
                **d,
                "recommended": figure(d.get("recommended")),
                "reference": figure(d.get("reference")),
                "front": tuple(Figure(**f) for f in d.get("front", ())),
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


def baseline(study: optuna.Study, which: str, device: str) -> Tuned:
    """The run a re-tune compares with: the last one on ``device`` with a recommendation, or the
    one named ``which``; ``ConfigError`` when there is none."""
    runs = [t for t in tuned_runs(study) if t.device == device and t.recommended is not None]
    if which != "last":
        named = [t for t in runs if t.name == which]
        if not named:
            raise ConfigError(
                f"retune.baseline={which!r} names no run of study '{study.study_name}' on "
                f"{device} with a recommendation; runs: {', '.join(t.name for t in runs) or 'none'}"
                " (python -m search history lists them)"
            )
        return named[-1]
    if not runs:
        raise ConfigError(
            f"study '{study.study_name}' has no tuning on {device} with a recommendation to "
            "compare with: run the tuning first (python -m search with the same arguments)"
        )
    return runs[-1]


def measure_reference(device: str, runs: int, seed: int) -> Pooled | None:
    """The reference step, measured in ``runs`` fresh processes (its figures pooled; the interval
    comes later, from the machine's noise floor: ``reference_figure``); None when a run failed."""
    if runs < 1:
        return None
    request = TrialRequest(REFERENCE_WORKLOAD, REFERENCE_CONFIG, device, seed, REFERENCE_MEASURE)
    results, times = [], []
    for _ in range(runs):
        results.append(run_isolated(request))
        times.append(time.time())
    pooled = pool(results, times, 0.95)
    return pooled if pooled.metrics else None


def reference_figure(
    pooled: Pooled, floor: NoiseFloor, stable: StableSettings, confidence: float
) -> Figure:
    """The reference step's mean with the interval of a mean of fresh runs on this machine (the
    between-run variance from the noise floor's control runs, as for any re-validated
    configuration)."""
    metrics, _ = assess_pooled(pooled.metrics, pooled.runs, floor, stable, confidence)
    return Figure(
        dict(REFERENCE_CONFIG),
        metrics["throughput"],
        metrics["throughput_ci_low"],
        metrics["throughput_ci_high"],
    )


# -- comparisons ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """``today / baseline`` of one throughput, with its interval."""

    what: str
    label: str
    """FASTER, SLOWER, SAME or AMBIGUOUS."""
    ratio: float
    low: float
    high: float

    def line(self) -> str:
        return (
            f"{self.what}: {self.label} {self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}] "
            "(today / baseline, 95% CI)"
        )


def _log_se(figure: Figure, confidence: float) -> float:
    """The standard error of the log of a figure, from its interval (normal approximation)."""
    if figure.low <= 0 or figure.high <= 0 or figure.throughput <= 0:
        return math.inf
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    return math.log(figure.high / figure.low) / (2 * z)


def compare(
    what: str,
    today: Figure,
    base: Figure,
    threshold: float,
    confidence: float = 0.95,
    sessions: Sessions | None = None,
) -> Comparison:
    """``today / base`` with an interval from both figures' intervals (independent, on the log
    scale) and, with ``sessions``, the machine's variance from one run to the next (twice: each
    side is one draw of it), with its t quantile. SLOWER or FASTER: the interval excludes 1
    (surely different); SAME: it lies within 1 ± ``threshold`` (surely not materially
    different); AMBIGUOUS: neither (as nvbench's compare)."""
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    ratio = today.throughput / base.throughput
    variance = _log_se(today, confidence) ** 2 + _log_se(base, confidence) ** 2
    if sessions is not None:
        q = float(stats.t.ppf(0.5 + confidence / 2, sessions.df))
        half = q * math.sqrt(variance + 2 * sessions.variance)
    else:
        half = z * math.sqrt(variance)
    return _labelled(what, ratio, half, threshold)


@dataclass(frozen=True)
class Sessions:
    """How much the machine's speed moves from one run to the next, beyond the noise within a
    run: the variance of the log of the reference step's mean over runs, less what the runs' own
    intervals explain (floored at 0), with its degrees of freedom (runs less one)."""

    variance: float
    df: int

    @classmethod
    def of(cls, references: Sequence[Figure], confidence: float = 0.95) -> Sessions | None:
        """From the reference step of each run (two at least); None with fewer."""
        usable = [f for f in references if f.throughput > 0 and f.low > 0]
        if len(usable) < 2:
            return None
        logs = [math.log(f.throughput) for f in usable]
        mean = sum(logs) / len(logs)
        spread = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
        within = sum(_log_se(f, confidence) ** 2 for f in usable) / len(usable)
        return cls(max(0.0, spread - within), len(usable) - 1)

    def line(self) -> str:
        return (
            f"the machine's speed moves by {math.sqrt(self.variance):.1%} (CV) from one run to the "
            f"next beyond the noise within a run ({self.df} df, from the reference step of "
            f"{self.df + 1} runs); every comparison holds it"
        )


@dataclass
class Conclusion:
    """A re-tune's verdicts against its baseline."""

    verdict: str
    line: str
    """The one verdict line for CI logs."""
    comparisons: list[Comparison] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    """What changed since the baseline (workload, environment fields, the machine's speed)."""
    sessions: Sessions | None = None
    """The machine's run-to-run variance the comparisons hold (None: not known yet)."""

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.verdict == REGRESSION else 0


def conclude(
    base: Tuned,
    today: Tuned,
    old_today: Figure | None,
    threshold: float,
    confidence: float = 0.95,
    sessions: Sessions | None = None,
) -> Conclusion:
    """The verdicts: the old recommendation today vs the baseline, today's best vs the baseline's,
    today's recommendation vs the old one measured today; and the overall one.

    Regression: today's best stable throughput is more than ``threshold`` below the baseline's
    (point estimate) and surely below it (the interval of the ratio lies under 1). Where both
    runs measured the reference step, the ratio at the same machine speed (divided by the
    reference step's) is reported too. Optimum moved:
    today's recommendation is another configuration and surely faster than the old one today.
    Improved: more than ``threshold`` above, surely. Ambiguous: none of these, but the interval
    reaches below 1 - ``threshold`` (a regression cannot be ruled out). Same: none of these."""
    assert base.recommended is not None
    comparisons = []
    if old_today is not None:
        comparisons.append(
            compare(
                "old recommendation, today vs baseline",
                old_today,
                base.recommended,
                threshold,
                confidence,
                sessions,
            )
        )
    best = today.recommended
    best_vs = (
        compare("best, today vs baseline", best, base.recommended, threshold, confidence, sessions)
        if best is not None
        else None
    )
    if best_vs is not None:
        comparisons.append(best_vs)
    moved_vs = None
    if best is not None and old_today is not None and best.config != base.recommended.config:
        moved_vs = compare(
            "today's recommendation vs the old one, both today",
            best,
            old_today,
            threshold,
            confidence,
        )
        comparisons.append(moved_vs)
    changed = what_changed(base, today, threshold, confidence)
    gate = best_vs
    if best_vs is not None and base.reference is not None and today.reference is not None:
        # The machine's own change between the two runs, read from the reference step (which
        # does not depend on the model), taken out: shown, not yet the gate (see the README).
        machine = compare("machine", today.reference, base.reference, threshold, confidence)
        comparisons.append(
            _relative(
                "best, today vs baseline, at the same machine speed", best_vs, machine, threshold
            )
        )
    if gate is None:
        verdict = REGRESSION  # nothing stable is left to recommend: surely worse than before
    elif gate.ratio < 1 - threshold and gate.high < 1:
        verdict = REGRESSION
    elif moved_vs is not None and moved_vs.low > 1:
        verdict = MOVED
    elif gate.label == "FASTER" and gate.ratio > 1 + threshold:
        verdict = IMPROVED
    elif gate.low < 1 - threshold:
        verdict = AMBIGUOUS  # it may be slower beyond the threshold: too noisy to tell
    else:
        verdict = SAME
    return Conclusion(
        verdict, _verdict_line(verdict, base, today, gate), comparisons, changed, sessions
    )


def _labelled(what: str, ratio: float, half: float, threshold: float) -> Comparison:
    """``ratio`` with its log-scale half-width ``half``, labelled as nvbench's compare does."""
    low, high = ratio * math.exp(-half), ratio * math.exp(half)
    if high < 1:
        label = "SLOWER"
    elif low > 1:
        label = "FASTER"
    elif 1 - threshold <= low and high <= 1 + threshold:
        label = "SAME"
    else:
        label = "AMBIGUOUS"
    return Comparison(what, label, ratio, low, high)


def _relative(what: str, a: Comparison, b: Comparison, threshold: float) -> Comparison:
    """``a / b``: the ratios divided, their log-scale half-widths added in quadrature."""
    ratio = a.ratio / b.ratio
    half = math.hypot(math.log(a.high / a.low) / 2, math.log(b.high / b.low) / 2)
    return _labelled(what, ratio, half, threshold)


def _verdict_line(verdict: str, base: Tuned, today: Tuned, gate: Comparison | None) -> str:
    same_machine = (
        " at the same machine speed" if gate is not None and "machine" in gate.what else ""
    )
    ratio = (
        f"best {gate.ratio:.3f}x [{gate.low:.3f}, {gate.high:.3f}] of baseline{same_machine}"
        if gate is not None
        else "no stable configuration to recommend today"
    )
    return f"retune: {verdict.upper()}: {ratio} ({base.name}); {today.name}"


VOLATILE_ENV = {"load_average_1min", "started"}
"""Environment fields that differ from run to run on an unchanged machine."""


def what_changed(base: Tuned, today: Tuned, threshold: float, confidence: float) -> list[str]:
    """What differs from the baseline: the workload, each environment field, the machine's speed
    (the reference step)."""
    changed = []
    if base.fingerprint != today.fingerprint:
        changed.append(
            f"workload: fingerprint {base.fingerprint[:12]} -> {today.fingerprint[:12]} (the "
            "model's source or settings, the device or torch)"
        )
    for key in sorted(set(base.env) | set(today.env)):
        if key in VOLATILE_ENV:
            continue
        if base.env.get(key) != today.env.get(key):
            changed.append(f"environment: {key} {base.env.get(key)!r} -> {today.env.get(key)!r}")
    if base.reference is not None and today.reference is not None:
        machine = compare("machine (reference step)", today.reference, base.reference, threshold)
        if machine.label in ("SLOWER", "FASTER"):
            changed.append(
                f"machine: the reference step is {machine.label.lower()} "
                f"({machine.ratio:.3f}x [{machine.low:.3f}, {machine.high:.3f}]): part of any "
                "change below is the machine's, not the model's"
            )
        else:
            changed.append(
                f"machine: the reference step is {machine.label.lower()} "
                f"({machine.ratio:.3f}x [{machine.low:.3f}, {machine.high:.3f}])"
            )
    return changed


# -- report and history ------------------------------------------------------------------------


def write_report(
    study_dir: Path, base: Tuned, today: Tuned, conclusion: Conclusion, knob_names: Sequence[str]
) -> tuple[Path, Path]:
    """``retune/<time>.md`` and ``.json`` under ``study_dir``."""
    folder = study_dir / "retune"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(today.time_s))
    data = {
        "verdict": conclusion.verdict,
        "line": conclusion.line,
        "comparisons": [asdict(c) for c in conclusion.comparisons],
        "changed": conclusion.changed,
        "run_to_run": None if conclusion.sessions is None else asdict(conclusion.sessions),
        "baseline": base.as_dict(),
        "today": today.as_dict(),
    }
    json_path = folder / f"{stamp}.json"
    json_path.write_text(json.dumps(data, indent=2, default=str))

    def shown(f: Figure | None) -> str:
        if f is None:
            return "none"
        knobs = ", ".join(f"{k}={f.config[k]}" for k in knob_names if k in f.config)
        return f"{knobs}: {f.throughput:.4g} [{f.low:.4g}, {f.high:.4g}] {today.unit}/s"

    lines = [
        f"# Re-tune {today.name}: {conclusion.verdict}",
        "",
        conclusion.line,
        "",
        "| comparison | verdict | ratio | 95% CI |",
        "|---|---|---|---|",
        *[
            f"| {c.what} | {c.label} | {c.ratio:.3f} | [{c.low:.3f}, {c.high:.3f}] |"
            for c in conclusion.comparisons
        ],
        "",
        "## What changed",
        "",
        *([f"- {c}" for c in conclusion.changed] or ["- nothing recorded"]),
        "",
        "## Recommendations",
        "",
        f"- baseline ({base.name}): {shown(base.recommended)}",
        f"- today ({today.name}): {shown(today.recommended)}",
        "",
    ]
    md_path = folder / f"{stamp}.md"
    md_path.write_text("\n".join(lines))
    return md_path, json_path


HISTORY_COLUMNS = ["name", "kind", "verdict", "throughput", "ci_low", "ci_high", "unit", "config"]


def history_rows(runs: Sequence[Tuned]) -> list[dict[str, Any]]:
    rows = []
    for t in runs:
        r = t.recommended
        rows.append(
            {
                "name": t.name,
                "kind": t.kind,
                "verdict": t.verdict or "-",
                "throughput": "" if r is None else f"{r.throughput:.6g}",
                "ci_low": "" if r is None else f"{r.low:.6g}",
                "ci_high": "" if r is None else f"{r.high:.6g}",
                "unit": f"{t.unit}/s",
                "config": "" if r is None else json.dumps(r.config, sort_keys=True),
            }
        )
    return rows


def write_history(study_dir: Path, runs: Sequence[Tuned], title: str) -> tuple[Path, Path]:
    """``history.csv`` and ``history.png``: the recommended configuration's throughput (with its
    interval) and which configuration it was, run after run."""
    study_dir.mkdir(parents=True, exist_ok=True)
    csv_path = study_dir / "history.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HISTORY_COLUMNS)
        writer.writeheader()
        writer.writerows(history_rows(runs))
    png_path = study_dir / "history.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [t for t in runs if t.recommended is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shown) + 2), 4.5))
    configs: list[str] = []
    for i, t in enumerate(shown):
        r = t.recommended
        assert r is not None
        key = json.dumps(r.config, sort_keys=True)
        if key not in configs:
            configs.append(key)
        color = f"C{configs.index(key) % 10}"
        ax.errorbar(
            [i],
            [r.throughput],
            yerr=[[r.throughput - r.low], [r.high - r.throughput]],
            fmt="o",
            color=color,
            capsize=4,
        )
        ax.annotate(
            f"#{configs.index(key) + 1}",
            (i, r.high),
            textcoords="offset points",
            xytext=(0, 4),
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(range(len(shown)), [t.name for t in shown], rotation=30, ha="right", fontsize=7)
    unit = shown[0].unit if shown else "items"
    ax.set_ylabel(f"recommended throughput ({unit}/s, 95% CI)")
    ax.set_title(title, fontsize=9)
    legend = "\n".join(f"#{i + 1}: {c}" for i, c in enumerate(configs))
    if legend:
        ax.text(1.01, 1.0, legend, transform=ax.transAxes, fontsize=6, va="top", family="monospace")
    fig.savefig(png_path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return csv_path, png_path


def run_history(cfg_node: Any) -> int:
    """``python -m search history``: the study's tunings and re-tunes as a table, and
    ``history.csv`` / ``history.png`` in ``runs_dir/<study>/``."""
    from rich.table import Table

    from search.config import load_settings, redact
    from search.report import console
    from search.stores import quiet_libraries, require_study

    quiet_libraries()
    settings = load_settings(cfg_node)
    name, storage = settings.study.name, settings.study.storage
    require_study(name, storage)
    study = optuna.load_study(study_name=name, storage=storage)
    runs = tuned_runs(study)
    if not runs:
        raise ConfigError(
            f"study '{name}' in {redact(storage)} has no finished tuning recorded yet: run the "
            "tuning first (python -m search with the same arguments)"
        )
    table = Table(title=f"{name}: the recommended configuration, run by run")
    for column in ("run", "verdict", "throughput (95% CI)", "configuration"):
        table.add_column(column)
    for row in history_rows(runs):
        figure = (
            f"{float(row['throughput']):.4g} [{float(row['ci_low']):.4g}, "
            f"{float(row['ci_high']):.4g}] {row['unit']}"
            if row["throughput"]
            else "none"
        )
        table.add_row(row["name"], row["verdict"], figure, row["config"] or "-")
    out = console()
    out.print(table)
    csv_path, png_path = write_history(
        Path(settings.runs_dir) / name, runs, f"{name}: recommended, run by run"
    )
    out.print(f"files: {csv_path}, {png_path.name}", markup=False)
    return 0
