"""Nightly re-tuning: did the model get slower, do the old best settings still hold, did the optimum
move?

Every tuning and re-tune ends by confirming its recommendation in fresh runs made after it was
chosen, each right after a fresh run of the reference step (``confirm``), and keeps what it
concluded in the Optuna study (``Tuned``), so that the next re-tune finds its baseline there even
when MLflow is down. A re-tune (``search.commands.tune``) re-measures the baseline's recommendation
and
front in fresh processes first, searches a little, confirms its own recommendation, and compares
fresh runs with fresh runs (``compare``, ``conclude``): each comparison is a ratio today / baseline
with a distribution-free interval from the ranks of the runs (``shift``).

The reference step (``search.workloads.reference``) is a fixed tiny training step of the built-in
GPT with a fixed matrix product: it does not depend on the space's model, so a slower machine is
not blamed on the model.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from scipy import stats

from search.config.compose import ConfigError
from search.core.records import COMPLETE, TrialRecord
from search.execution.worker import TrialRequest, TrialResult, run_isolated
from search.measurement.protocol import MeasureSettings, t_quantile
from search.study.trial_store import retried

__all__ = [
    "AMBIGUOUS",
    "Comparison",
    "Conclusion",
    "Confirmed",
    "EXACT_UP_TO",
    "EXIT_REGRESSION",
    "Figure",
    "HISTORY_COLUMNS",
    "IMPROVED",
    "MIN_RUNS",
    "MOVED",
    "REFERENCE_CONFIG",
    "REFERENCE_MEASURE",
    "REFERENCE_WORKLOAD",
    "REGRESSION",
    "RETUNE",
    "SAME",
    "SOFTWARE_ENV",
    "TUNE",
    "TUNED_PREFIX",
    "Tuned",
    "VOLATILE_ENV",
    "at_machine_speed",
    "baseline",
    "comparable",
    "compare",
    "conclude",
    "confirm",
    "history_rows",
    "reference_workload",
    "run_history",
    "runs_needed",
    "save_tuned",
    "sensitivity",
    "shift",
    "software_changes",
    "tuned_runs",
    "what_changed",
    "write_history",
    "write_report",
]

TUNED_PREFIX = "tuned:"
"""Study user attr ``tuned:<time>``: what one tuning or re-tune concluded (``Tuned``)."""

REFERENCE_WORKLOAD = {
    "_target_": "search.workloads.reference.ReferenceStep",
    "vocab_size": 256,
    "seq_len": 32,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
}
"""The reference step's model: fixed, whatever the space (its matrix size is fixed per device
type: ``reference_workload``)."""


def reference_workload(device: str) -> dict[str, Any]:
    """The reference step's workload on ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""
    from search.workloads.reference import MATMUL

    size, repeats = MATMUL[device.split(":")[0]]
    return {**REFERENCE_WORKLOAD, "matmul_size": size, "matmul_repeats": repeats}


REFERENCE_CONFIG = {"batch_size": 8, "micro_batch_size": 8, "precision": "fp32"}
REFERENCE_MEASURE = MeasureSettings(
    warmup_steps=2, warmup_s=0.3, window_s=0.1, min_windows=5, max_windows=10, max_time_s=2.0
)
"""Short: a run's mean varies from process to process by far more than its windows say (several
percent on a shared CPU), so a longer run would buy little."""

MIN_RUNS = 4
"""Fewest fresh runs a side of a comparison needs: with 4 and 4 the exact Mann-Whitney test can
reject at 5% (with 3 and 3 it cannot, and every interval is unbounded)."""
EXACT_UP_TO = 30
"""Up to this many runs a side, ``shift`` uses the exact Mann-Whitney distribution."""

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
    """A configuration's throughput with its 95% interval (items/s), and the fresh-process runs
    behind it where a comparison needs them."""

    config: dict[str, Any]
    throughput: float
    low: float
    high: float
    trial: int | None = None
    runs: tuple[float, ...] = ()
    """Mean throughput of each fresh-process run behind the figure (items/s): what comparisons
    rank. Empty for a figure of the search (a front entry)."""
    references: tuple[float, ...] = ()
    """The reference step's throughput in the run just before each of ``runs`` (items/s; the
    confirmation pairs them), empty where it was not measured."""

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

    @classmethod
    def measured(
        cls,
        config: Mapping[str, Any],
        runs: Sequence[float],
        references: Sequence[float] = (),
        confidence: float = 0.95,
        trial: int | None = None,
    ) -> Figure:
        """The geometric mean of ``runs`` with its t-interval on the log scale (runs are fresh
        processes: their spread is the between-run spread)."""
        logs = np.log(np.asarray(runs, dtype=float))
        mean = float(np.mean(logs))
        spread = float(np.std(logs, ddof=1)) if len(logs) > 1 else math.inf
        half = t_quantile(confidence, len(logs) - 1) * spread / math.sqrt(len(logs))
        return cls(
            dict(config),
            math.exp(mean),
            math.exp(mean - half),
            math.exp(mean + half) if math.isfinite(half) else math.inf,
            trial,
            tuple(float(r) for r in runs),
            tuple(float(r) for r in references),
        )

    @property
    def reference(self) -> Figure | None:
        """The reference step of the runs behind this figure, as a figure of its own."""
        return Figure.measured({}, self.references) if len(self.references) > 1 else None


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
    """The recommendation as its confirmation runs measured it (``confirm``): the figure
    re-tunes compare with."""
    front: tuple[Figure, ...] = ()
    mlflow_run_id: str | None = None
    verdict: str = ""
    """A re-tune's overall verdict (``regression``, ``moved``, ...); '' for a tuning."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tuned:
        def figure(f: Mapping[str, Any] | None) -> Figure | None:
            if f is None:
                return None
            return Figure(
                **{
                    **f,
                    "runs": tuple(f.get("runs", ())),
                    "references": tuple(f.get("references", ())),
                }
            )

        known = {f.name for f in fields(cls)}
        return cls(
            **{
                **{k: v for k, v in d.items() if k in known},
                "recommended": figure(d.get("recommended")),
                "front": tuple(figure(f) for f in d.get("front", ())),
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


def comparable(t: Tuned) -> bool:
    """Whether a re-tune can compare with ``t``: its recommendation was confirmed in fresh runs."""
    return t.recommended is not None and len(t.recommended.runs) >= MIN_RUNS


def baseline(study: optuna.Study, which: str, device: str) -> Tuned:
    """The run a re-tune compares with: the last one on ``device`` whose recommendation was
    confirmed, or the one named ``which``; ``ConfigError`` when there is none."""
    on_device = [t for t in tuned_runs(study) if t.device == device]
    runs = [t for t in on_device if comparable(t)]
    if which != "last":
        named = [t for t in runs if t.name == which]
        if not named:
            raise ConfigError(
                f"retune.baseline={which!r} names no run of study '{study.study_name}' on "
                f"{device} with a confirmed recommendation; runs: "
                f"{', '.join(t.name for t in runs) or 'none'} (python -m search history lists "
                "them)"
            )
        return named[-1]
    if not runs:
        unconfirmed = [t for t in on_device if t.recommended is not None]
        raise ConfigError(
            f"study '{study.study_name}' has no tuning on {device} with a confirmed "
            "recommendation to compare with: run the tuning first (python -m search with the "
            "same arguments" + (f", and retune.confirm >= {MIN_RUNS}" if unconfirmed else "") + ")"
        )
    return runs[-1]


@dataclass(frozen=True)
class Confirmed:
    """What ``confirm`` measured: a figure per configuration (None where fewer than
    ``MIN_RUNS`` rounds completed) and a line per failed run."""

    figures: list[Figure | None]
    failures: list[str]


def confirm(
    configs: Sequence[Mapping[str, Any]],
    request: Callable[[Mapping[str, Any]], TrialRequest],
    device: str,
    rounds: int,
    seed: int,
    confidence: float,
    progress: Callable[[int, int, TrialResult | None, list[TrialResult]], None],
    with_reference: bool = True,
) -> Confirmed:
    """``configs`` (today's recommendation first, and the old one when it differs) measured in
    ``rounds`` rounds of fresh processes after the recommendation was chosen, each round a fresh run
    of the reference step and then one of each configuration.

    A figure chosen as the best of several reads high (the winner's curse: of near-ties, the one
    whose noise fell highest wins); runs made after the choice do not. The reference step, measured
    in turn with them, tells the machine's speed at the same moments, and configurations measured
    in the same rounds are compared at the same moments. A round whose reference run failed is
    left out for every configuration (its runs could not be put at the machine's speed); a failed
    run of a configuration leaves out only that run."""
    runs: list[list[float]] = [[] for _ in configs]
    references: list[list[float]] = [[] for _ in configs]
    failures: list[str] = []
    reference = TrialRequest(
        reference_workload(device),
        REFERENCE_CONFIG,
        device,
        seed,
        REFERENCE_MEASURE,
        fidelity=False,
        count=False,
    )
    for i in range(rounds):
        ref = run_isolated(replace(reference, seed=seed + i)) if with_reference else None
        results = [
            run_isolated(replace(request(c), seed=seed + i, fidelity=False, count=False))
            for c in configs
        ]
        progress(i + 1, rounds, ref, results)
        if ref is not None and (ref.state != COMPLETE or ref.measurement is None):
            failures.append(f"round {i + 1}: reference step: {ref.failure}")
            continue
        for k, result in enumerate(results):
            if result.state != COMPLETE or result.measurement is None:
                failures.append(f"round {i + 1}: {result.failure}")
                continue
            runs[k].append(result.measurement.throughput)
            if ref is not None and ref.measurement is not None:
                references[k].append(ref.measurement.throughput)
    figures = [
        Figure.measured(c, r, refs, confidence) if len(r) >= MIN_RUNS else None
        for c, r, refs in zip(configs, runs, references, strict=True)
    ]
    return Confirmed(figures, failures)


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
    runs: tuple[int, int] = (0, 0)
    """Fresh-process runs behind it: today's, the baseline's."""

    def line(self) -> str:
        return (
            f"{self.what}: {self.label} {self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}] "
            f"(today / baseline, 95% CI, {self.runs[0]} vs {self.runs[1]} fresh runs)"
        )


def shift(
    today: Sequence[float], base: Sequence[float], confidence: float = 0.95
) -> tuple[float, float, float]:
    """``today / base`` as a ratio with its interval: the Hodges-Lehmann estimate of the shift
    between the logs of the two samples of runs (the median of all pairwise differences) and the
    distribution-free interval of the shifts that the two-sided exact Mann-Whitney test does not
    reject at ``1 - confidence``.

    Ranks, not means: one run that landed at half speed (a process whose threads shared a core
    with another's) moves a mean and widens a t-interval, but moves ranks by one step. The
    interval needs no assumption on the shape of the runs' spread, only that runs are
    independent draws of their side; its bounds are pairwise differences, and with few runs
    (3 and 3) it is unbounded: nothing can be told at 95% from so few."""
    x = np.log(np.asarray(today, dtype=float))
    y = np.log(np.asarray(base, dtype=float))
    d = np.sort(np.subtract.outer(x, y).ravel())
    estimate = float(np.median(d))
    alpha = 1 - confidence
    method = "exact" if max(len(x), len(y)) <= EXACT_UP_TO else "asymptotic"

    def accepted(delta: float) -> bool:
        return bool(stats.mannwhitneyu(x - delta, y, method=method).pvalue > alpha)

    # The test's statistic changes only at the pairwise differences: try a shift between each
    # neighbouring pair, and beyond both ends.
    probes = [d[0] - 1.0, *((d[:-1] + d[1:]) / 2), d[-1] + 1.0]
    inside = [i for i, p in enumerate(probes) if accepted(float(p))]
    low = -math.inf if inside[0] == 0 else float(d[inside[0] - 1])
    high = math.inf if inside[-1] == len(probes) - 1 else float(d[inside[-1]])
    return math.exp(estimate), math.exp(low), math.exp(high)


def compare(
    what: str,
    today: Sequence[float],
    base: Sequence[float],
    threshold: float,
    confidence: float = 0.95,
) -> Comparison:
    """``today / base`` of two samples of fresh-process runs (``shift``), labelled as nvbench's
    compare does: SLOWER or FASTER when the interval excludes 1 (surely different); SAME when it
    lies within 1 ± ``threshold`` (surely not materially different); AMBIGUOUS otherwise."""
    ratio, low, high = shift(today, base, confidence)
    if high < 1:
        label = "SLOWER"
    elif low > 1:
        label = "FASTER"
    elif 1 - threshold <= low and high <= 1 + threshold:
        label = "SAME"
    else:
        label = "AMBIGUOUS"
    return Comparison(what, label, ratio, low, high, (len(today), len(base)))


@dataclass
class Conclusion:
    """A re-tune's verdicts against its baseline."""

    verdict: str
    line: str
    """The one verdict line for CI logs."""
    comparisons: list[Comparison] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    """What changed since the baseline (workload, environment fields, the machine's speed)."""
    gate: Comparison | None = None
    """The comparison the verdict rests on."""
    hint: str = ""
    """For an ambiguous verdict: how much the runs spread, and how many it would take to tell a
    change of the threshold's size."""

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.verdict == REGRESSION else 0


def sensitivity(*figures: Figure) -> float:
    """How much the workload's speed follows the machine's: the slope of log throughput on the
    log of the reference step run just before it, pooled within nights (each figure's runs about
    their own means, so a change between nights does not enter), clipped to [0, 1]. 0 where the
    references did not vary.

    A workload whose speed follows the reference step (1) is corrected by it in full; one that
    does not (a sleeping workload, a GPU-bound one on a host that slowed) is not corrected at all:
    dividing it by the reference step would only add the reference's own noise."""
    xs, ys = [], []
    for f in figures:
        if len(f.references) >= 2 and len(f.references) == len(f.runs):
            x = np.log(np.asarray(f.references, dtype=float))
            y = np.log(np.asarray(f.runs, dtype=float))
            xs.append(x - x.mean())
            ys.append(y - y.mean())
    if not xs:
        return 0.0
    x, y = np.concatenate(xs), np.concatenate(ys)
    spread = float(np.dot(x, x))
    return float(np.clip(np.dot(x, y) / spread, 0.0, 1.0)) if spread > 0 else 0.0


def at_machine_speed(f: Figure, beta: float) -> list[float]:
    """Each run's throughput divided by the reference step's just before it, to the power of the
    workload's ``sensitivity`` ``beta``."""
    return [r / ref**beta for r, ref in zip(f.runs, f.references, strict=True)]


def conclude(
    base: Tuned,
    today: Tuned,
    old_today: Figure | None,
    threshold: float,
    confidence: float = 0.95,
) -> Conclusion:
    """The verdicts: the old recommendation today vs the baseline, today's best vs the baseline's,
    the machine (the reference step), the best at the same machine speed, today's recommendation
    vs the old one today; and the overall one. Every figure is a set of confirmation runs:
    ``old_today`` is the old recommendation as today's confirmation measured it (in the same rounds
    as today's recommendation, or the same runs when it is the same configuration).

    The gate is today's best vs the baseline's; where both runs measured the reference step, the
    same ratio at the same machine speed (each run divided by the reference step just before it,
    to the power of the workload's ``sensitivity``) must agree with it, so that a slower machine
    is not blamed on the model. Not when the software changed (``SOFTWARE_ENV``: torch, CUDA, the
    driver, ...): the reference step runs on it too, and a slower torch is a regression, not a
    slower machine. Regression: today's best is more than ``threshold`` below the baseline's and
    surely below it (the interval lies under 1), and the estimate at the same machine speed more
    than ``threshold`` below too; or nothing stable is left to recommend. Optimum moved: today's
    recommendation is another configuration, more than ``threshold`` and surely faster than the
    old one measured in the same rounds. Improved: as a regression, the other way. Same: the last
    gate's interval lies within 1 ± ``threshold``. Ambiguous: none of these, or today's
    recommendation could not be confirmed.
    """
    assert base.recommended is not None
    old = base.recommended
    best = today.recommended
    changed = what_changed(base, today)
    if best is None:
        line = f"retune: REGRESSION: no stable configuration to recommend today ({base.name})"
        return Conclusion(REGRESSION, f"{line}; {today.name}", [], changed)
    if len(best.runs) < MIN_RUNS:
        line = (
            "retune: AMBIGUOUS: today's recommendation could not be confirmed in fresh runs "
            f"({base.name}); {today.name}"
        )
        return Conclusion(AMBIGUOUS, line, [], changed)
    comparisons = []
    same_config = old_today is not None and old_today.config == best.config
    if old_today is not None and not same_config and len(old_today.runs) >= MIN_RUNS:
        comparisons.append(
            compare(
                "old recommendation, today vs baseline",
                old_today.runs,
                old.runs,
                threshold,
                confidence,
            )
        )
    what = "best, today vs baseline" + (" (the same configuration)" if same_config else "")
    best_vs = compare(what, best.runs, old.runs, threshold, confidence)
    comparisons.append(best_vs)
    machine = adjusted = moved_vs = None
    beta = 0.0
    software = software_changes(base, today)
    if len(best.references) >= MIN_RUNS and len(old.references) >= MIN_RUNS:
        machine = compare(
            "machine: the reference step, today vs baseline",
            best.references,
            old.references,
            threshold,
            confidence,
        )
        beta = sensitivity(best, old)
        adjusted = compare(
            "best, today vs baseline, at the same machine speed",
            at_machine_speed(best, beta),
            at_machine_speed(old, beta),
            threshold,
            confidence,
        )
        comparisons += [machine, adjusted]
    changed += _machine_lines(machine, software, base, today, beta)
    if old_today is not None and not same_config and len(old_today.runs) >= MIN_RUNS:
        moved_vs = compare(
            "today's recommendation vs the old one, both today",
            best.runs,
            old_today.runs,
            threshold,
            confidence,
        )
        comparisons.append(moved_vs)
    # The ratio as measured must be surely beyond 1 and beyond the threshold, and the estimate
    # at the same machine speed beyond the threshold too, before the model is called slower or
    # faster: the first alone would blame a slower machine on the model (this machine's speed
    # moves by several percent from one hour to the next, and runs of one invocation share the
    # moment); the second, surely, would lose the power the reference's own noise costs.
    gates = [best_vs] + ([adjusted] if adjusted is not None and not software else [])
    gate = gates[-1]

    def slower(c: Comparison) -> bool:
        return c.ratio < 1 - threshold and c.high < 1

    def faster(c: Comparison) -> bool:
        return c.ratio > 1 + threshold and c.low > 1

    def agrees(c: Comparison, direction: int) -> bool:
        return c.ratio < 1 - threshold if direction < 0 else c.ratio > 1 + threshold

    if slower(best_vs) and all(agrees(g, -1) for g in gates[1:]):
        verdict = REGRESSION
    elif moved_vs is not None and faster(moved_vs):
        verdict, gate = MOVED, moved_vs
    elif faster(best_vs) and all(agrees(g, +1) for g in gates[1:]):
        verdict = IMPROVED
    elif 1 - threshold <= gate.low and gate.high <= 1 + threshold:
        verdict = SAME  # surely no material change (at the same machine speed, where measured)
    else:
        verdict = AMBIGUOUS  # a change beyond the threshold can be neither shown nor ruled out
    hint = ""
    if verdict == AMBIGUOUS:
        samples = (
            (at_machine_speed(best, beta), at_machine_speed(old, beta))
            if gate is adjusted
            else (list(best.runs), list(old.runs))
        )
        hint = runs_needed(*samples, threshold, confidence)
    line = _verdict_line(verdict, base, today, gates, moved_vs if verdict == MOVED else None)
    return Conclusion(verdict, line, comparisons, changed, gate, hint)


def runs_needed(
    today: Sequence[float], base: Sequence[float], threshold: float, confidence: float = 0.95
) -> str:
    """How much two samples of runs spread (the CV of their logs), and about how many runs a side
    would make the interval of their ratio as narrow as ``threshold`` (normal approximation:
    half-width z·s·sqrt(2/n)), as one line; when they are that many already, that the change
    lies near the threshold, where more runs narrow the interval but may not decide."""
    spreads = [float(np.std(np.log(x), ddof=1)) for x in (today, base) if len(x) > 1]
    if not spreads:
        return ""
    s = math.sqrt(sum(v**2 for v in spreads) / len(spreads))
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    n = math.ceil(2 * (z * s / -math.log(1 - threshold)) ** 2)
    spread = f"the runs spread by {spreads[0]:.1%} today and {spreads[-1]:.1%} at the baseline (CV)"
    if n <= min(len(today), len(base)):
        estimate = math.exp(float(np.median(np.subtract.outer(np.log(today), np.log(base)))))
        return (
            f"near the threshold: {spread}, enough for an interval as narrow as ±{threshold:.0%}, "
            f"but the change ({estimate:.3f}x) lies so near 1 - {threshold:.0%} or 1 that the "
            "interval reaches across: more runs (retune.confirm) narrow it further"
        )
    return (
        f"too noisy to tell: {spread}; an interval as narrow as ±{threshold:.0%} needs about "
        f"{max(n, MIN_RUNS)} runs a side (retune.confirm), or a steadier machine"
    )


def _verdict_line(
    verdict: str,
    base: Tuned,
    today: Tuned,
    gates: Sequence[Comparison],
    moved: Comparison | None = None,
) -> str:
    def shown(c: Comparison) -> str:
        return f"{c.ratio:.3f}x [{c.low:.3f}, {c.high:.3f}]"

    figures = f"best {shown(gates[0])} of baseline" + (
        f", {shown(gates[1])} at the same machine speed" if len(gates) > 1 else ""
    )
    if moved is not None:
        figures = f"today's recommendation {shown(moved)} of the old one, both today; {figures}"
    return f"retune: {verdict.upper()}: {figures} ({base.name}); {today.name}"


VOLATILE_ENV = {"load_average_1min", "started", "gpu_sm_clock_mhz", "gpu_mem_clock_mhz"}
"""Environment fields that differ from run to run on an unchanged machine (readings)."""
SOFTWARE_ENV = (
    "torch",
    "python",
    "cuda",
    "cudnn",
    "gpu_driver",
    "platform",
    "search_version",
    "search_git_commit",
)
"""The software the reference step runs on as well as the model: when one of these changed, a
slower reference step is no evidence of a slower machine. The working directory's commit is the
model's side (what a re-tune is for), the host and the CPU or GPU the machine's."""


def _differing(base: Tuned, today: Tuned) -> list[str]:
    return [
        key
        for key in sorted(set(base.env) | set(today.env))
        if key not in VOLATILE_ENV and base.env.get(key) != today.env.get(key)
    ]


def software_changes(base: Tuned, today: Tuned) -> list[str]:
    """The software fields (``SOFTWARE_ENV``) that differ from the baseline."""
    return [key for key in _differing(base, today) if key in SOFTWARE_ENV]


def what_changed(base: Tuned, today: Tuned) -> list[str]:
    """What differs from the baseline: the workload and each environment field (the machine's
    speed is added by ``conclude``)."""
    changed = []
    if base.fingerprint != today.fingerprint:
        changed.append(
            f"workload: fingerprint {base.fingerprint[:12]} -> {today.fingerprint[:12]} (the "
            "model's source or settings, the device or torch)"
        )
    for key in _differing(base, today):
        changed.append(f"environment: {key} {base.env.get(key)!r} -> {today.env.get(key)!r}")
    return changed


def _machine_lines(
    machine: Comparison | None,
    software: Sequence[str],
    base: Tuned,
    today: Tuned,
    beta: float = 0.0,
) -> list[str]:
    """What the reference step says of the machine, and whether the verdict uses it."""
    if machine is None:
        missing = [
            who
            for who, t in (("the baseline", base), ("today", today))
            if t.recommended is None or len(t.recommended.references) < MIN_RUNS
        ]
        return [
            f"machine: not compared ({' and '.join(missing)} measured no reference step): a "
            "slower machine reads as a slower model"
        ]
    figures = f"({machine.ratio:.3f}x [{machine.low:.3f}, {machine.high:.3f}])"
    line = (
        f"machine: the reference step is {machine.label.lower()} {figures}; the workload follows "
        f"it with sensitivity {beta:.2f} (0: not at all, 1: in full)"
    )
    if software:
        return [
            f"{line}; the software changed ({', '.join(software)}) and the reference step runs on "
            "it too, so the verdict rests on the ratio as measured"
        ]
    if machine.label in ("SLOWER", "FASTER"):
        return [f"{line}: the machine's own speed changed; the verdict holds it"]
    return [line]


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
        "comparisons": [_finite_or_none(asdict(c)) for c in conclusion.comparisons],
        "changed": conclusion.changed,
        "gate": None if conclusion.gate is None else conclusion.gate.what,
        "hint": conclusion.hint,
        "baseline": base.as_dict(),
        "today": today.as_dict(),
    }
    json_path = folder / f"{stamp}.json"
    json_path.write_text(json.dumps(data, indent=2, default=str))

    def shown_config(f: Figure | None) -> str:
        if f is None:
            return "none"
        return ", ".join(f"{k}={f.config[k]}" for k in knob_names if k in f.config)

    def shown(f: Figure | None) -> str:
        if f is None:
            return "none"
        return (
            f"{shown_config(f)}: {f.throughput:.4g} [{f.low:.4g}, {f.high:.4g}] {today.unit}/s"
            + (f" ({len(f.runs)} fresh runs)" if f.runs else "")
        )

    lines = [
        f"# Re-tune {today.name}: {conclusion.verdict}",
        "",
        conclusion.line,
        "",
        *(
            [
                f"Optimum moved: {shown_config(base.recommended)} -> "
                f"{shown_config(today.recommended)}",
                "",
            ]
            if conclusion.verdict == MOVED
            else []
        ),
        "| comparison | verdict | ratio | 95% CI | fresh runs (today, baseline) |",
        "|---|---|---|---|---|",
        *[
            f"| {c.what} | {c.label} | {c.ratio:.3f} | [{c.low:.3f}, {c.high:.3f}] | "
            f"{c.runs[0]}, {c.runs[1]} |"
            for c in conclusion.comparisons
        ],
        "",
        *([conclusion.hint, ""] if conclusion.hint else []),
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


def _finite_or_none(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with infinite numbers (an unbounded interval) as None: JSON has no infinity."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}


HISTORY_COLUMNS = [
    "name",
    "kind",
    "device",
    "verdict",
    "throughput",
    "ci_low",
    "ci_high",
    "unit",
    "confirmed_runs",
    "config",
]
"""``confirmed_runs``: the fresh runs behind the figure (0: a search figure, never confirmed; such a
run cannot be a re-tune's baseline)."""


def history_rows(runs: Sequence[Tuned]) -> list[dict[str, Any]]:
    rows = []
    for t in runs:
        r = t.recommended
        rows.append(
            {
                "name": t.name,
                "kind": t.kind,
                "device": t.device,
                "verdict": t.verdict or "-",
                "throughput": "" if r is None else f"{r.throughput:.6g}",
                "ci_low": "" if r is None else f"{r.low:.6g}",
                "ci_high": "" if r is None else f"{r.high:.6g}",
                "unit": f"{t.unit}/s",
                "confirmed_runs": 0 if r is None else len(r.runs),
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

    from search.config.compose import load_settings, redact
    from search.reporting.report import console
    from search.study.stores import quiet_libraries, require_study

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
    for column in ("run", "device", "verdict", "throughput (95% CI)", "runs", "configuration"):
        table.add_column(column)
    for row in history_rows(runs):
        figure = (
            f"{float(row['throughput']):.4g} [{float(row['ci_low']):.4g}, "
            f"{float(row['ci_high']):.4g}] {row['unit']}"
            if row["throughput"]
            else "none"
        )
        confirmed = str(row["confirmed_runs"]) if row["confirmed_runs"] else "unconfirmed"
        table.add_row(
            row["name"], row["device"], row["verdict"], figure, confirmed, row["config"] or "-"
        )
    out = console()
    out.print(table)
    csv_path, png_path = write_history(
        Path(settings.runs_dir) / name, runs, f"{name}: recommended, run by run"
    )
    out.print(f"files: {csv_path}, {png_path.name}", markup=False)
    return 0
