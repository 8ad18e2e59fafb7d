"""The verdict of a re-tune: regression, moved, improved, same or ambiguous, from its comparisons
with the baseline, and the one line CI logs show."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from search.retuning.comparison import (
    MIN_RUNS,
    Comparison,
    at_machine_speed,
    compare,
    runs_needed,
    sensitivity_interval,
)
from search.retuning.environment_diff import machine_lines, software_changes, what_changed
from search.retuning.figure import Figure
from search.retuning.tuned import Tuned

__all__ = [
    "AMBIGUOUS",
    "EXIT_REGRESSION",
    "IMPROVED",
    "MOVED",
    "REGRESSION",
    "SAME",
    "Conclusion",
    "conclude",
    "held_back",
]

REGRESSION, MOVED, IMPROVED, SAME, AMBIGUOUS = (
    "regression",
    "moved",
    "improved",
    "same",
    "ambiguous",
)
EXIT_REGRESSION = 3


@dataclass(kw_only=True)
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
    kept: Comparison | None = None
    """Where the search's best today was another configuration than the old recommendation but
    not surely faster than it by more than the threshold (``held_back``): that comparison; the
    old recommendation stayed."""

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSION if self.verdict == REGRESSION else 0


def held_back(
    best: Figure, old_today: Figure | None, threshold: float, confidence: float = 0.95
) -> Comparison | None:
    """Today's best against the old recommendation measured in the same rounds, where they are
    two configurations and today's best is not surely faster by more than ``threshold``: then the
    old one stays recommended, and this comparison says why; None where the best may take its
    place (it is the same configuration, the old one was not measured today in ``MIN_RUNS``
    rounds, or the best is faster by the rule of a ``MOVED`` verdict).

    Two near-equal configurations trade places from one night to the next as the noise falls; a
    recommendation that flips with it would move every night's baseline, deployment and history
    without a change to show for it. So the recommendation moves exactly when the verdict says
    the optimum moved."""
    if old_today is None or old_today.config == best.config or len(old_today.runs) < MIN_RUNS:
        return None
    c = compare(
        "today's best vs the old recommendation, both today",
        best.runs,
        old_today.runs,
        threshold,
        confidence,
    )
    return None if _faster(c, threshold) else c


def _faster(c: Comparison, threshold: float) -> bool:
    """Surely faster, and by more than ``threshold`` at the estimate: the rule of ``MOVED`` and
    ``IMPROVED``."""
    return c.ratio > 1 + threshold and c.low > 1


def conclude(
    base: Tuned,
    today: Tuned,
    old_today: Figure | None,
    threshold: float,
    confidence: float = 0.95,
    kept: Comparison | None = None,
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
    recommendation could not be confirmed. ``kept``: the comparison that kept the old
    recommendation (``held_back``), listed with the rest."""
    assert base.recommended is not None
    old = base.recommended
    best = today.recommended
    changed = what_changed(base, today)
    if best is None or len(best.runs) < MIN_RUNS:
        return _unconfirmed(base, today, best, changed)
    ratios = _ratios(best, old, old_today, threshold, confidence)
    software = software_changes(base, today)
    changed += machine_lines(ratios.machine, software, base, today, ratios.betas)
    # The ratio as measured must be surely beyond 1 and beyond the threshold, and the estimate
    # at the same machine speed beyond the threshold too, before the model is called slower or
    # faster: the first alone would blame a slower machine on the model (this machine's speed
    # moves by several percent from one hour to the next, and runs of one invocation share the
    # moment); the second, surely, would lose the power the reference's own noise costs.
    # Read at both ends of the sensitivity's interval too (a few runs a night): an unchanged
    # workload that followed a 16% slower machine at sensitivity 0.00 [0, 0.7] was a regression.
    adjusted = ratios.adjusted
    corrected = [] if adjusted is None or software else [adjusted, *ratios.extremes]
    gates = [ratios.best] + corrected[:1]
    verdict, gate = _decide(ratios.best, corrected, ratios.moved, threshold)
    hint = (
        _hint(best, old, ratios, corrected, threshold, confidence) if verdict == AMBIGUOUS else ""
    )
    moved = ratios.moved if verdict == MOVED else None
    return Conclusion(
        verdict=verdict,
        line=_verdict_line(verdict, base, today, gates, moved),
        comparisons=ratios.listed + ([kept] if kept is not None else []),
        changed=changed,
        gate=gate,
        hint=hint,
        kept=kept,
    )


def _hint(
    best: Figure,
    old: Figure,
    ratios: _Ratios,
    corrected: Sequence[Comparison],
    threshold: float,
    confidence: float,
) -> str:
    """Why an ambiguous verdict is ambiguous: the machine's speed moved and the workload's
    sensitivity to it is not pinned down, or how much the runs spread and how many would tell."""

    def side(c: Comparison) -> int:
        return (c.ratio > 1 + threshold) - (c.ratio < 1 - threshold)

    if corrected and len({side(c) for c in corrected}) > 1:
        low, high = ratios.betas[1:]
        ends = ", ".join(
            f"{c.ratio:.3f}x at {b:.2f}" for c, b in zip(corrected[1:], (low, high), strict=True)
        )
        return (
            f"the machine's speed moved too and how far this workload follows it is known only "
            f"within sensitivity [{low:.2f}, {high:.2f}]: the best reads {ends}; more "
            "confirmation rounds (retune.confirm) pin the sensitivity down"
        )
    samples = (
        (at_machine_speed(best, ratios.betas[0]), at_machine_speed(old, ratios.betas[0]))
        if corrected
        else (list(best.runs), list(old.runs))
    )
    return runs_needed(*samples, threshold, confidence)


def _unconfirmed(base: Tuned, today: Tuned, best: Figure | None, changed: list[str]) -> Conclusion:
    """The conclusion when today's recommendation cannot be compared: nothing stable is left to
    recommend (a regression), or too few of its confirmation runs completed (ambiguous)."""
    if best is None:
        line = f"retune: REGRESSION: no stable configuration to recommend today ({base.name})"
        return Conclusion(
            verdict=REGRESSION, line=f"{line}; {today.name}", comparisons=[], changed=changed
        )
    line = (
        "retune: AMBIGUOUS: today's recommendation could not be confirmed in fresh runs "
        f"({base.name}); {today.name}"
    )
    return Conclusion(verdict=AMBIGUOUS, line=line, comparisons=[], changed=changed)


@dataclass(frozen=True, kw_only=True)
class _Ratios:
    """A re-tune's comparisons with its baseline, each of two sets of confirmation runs."""

    listed: list[Comparison]
    """All of them, in the order the report shows them."""
    best: Comparison
    """Today's best vs the baseline's: the first gate."""
    machine: Comparison | None
    """The reference step, today vs the baseline, where both measured it."""
    adjusted: Comparison | None
    """``best`` at the same machine speed, where both measured the reference step."""
    betas: tuple[float, float, float]
    """The workload's ``sensitivity`` to the machine's speed with its 95% interval
    (``sensitivity_interval``; (0, 0, 1) where it was not measured)."""
    extremes: list[Comparison]
    """``adjusted`` at both ends of the sensitivity's interval, for the verdict only."""
    moved: Comparison | None
    """Today's recommendation vs the old one, both today, where they differ."""


def _ratios(
    best: Figure, old: Figure, old_today: Figure | None, threshold: float, confidence: float
) -> _Ratios:
    """Today's comparisons with the baseline (see ``conclude``): the old recommendation today vs
    the baseline, today's best vs the baseline's, the machine and the best at the same machine
    speed, today's recommendation vs the old one today."""
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
    machine, betas, speeds = _at_machine_speed(best, old, threshold, confidence)
    if machine is not None and speeds:
        comparisons += [machine, speeds[0]]
    moved_vs = None
    if old_today is not None and not same_config and len(old_today.runs) >= MIN_RUNS:
        moved_vs = compare(
            "today's recommendation vs the old one, both today",
            best.runs,
            old_today.runs,
            threshold,
            confidence,
        )
        comparisons.append(moved_vs)
    return _Ratios(
        listed=comparisons,
        best=best_vs,
        machine=machine,
        adjusted=speeds[0] if speeds else None,
        betas=betas,
        extremes=speeds[1:],
        moved=moved_vs,
    )


def _at_machine_speed(
    best: Figure, old: Figure, threshold: float, confidence: float
) -> tuple[Comparison | None, tuple[float, float, float], list[Comparison]]:
    """The reference step today vs the baseline, the workload's ``sensitivity_interval`` to it,
    and today's best vs the baseline's at the same machine speed, at the sensitivity's estimate
    and at both ends of its interval; (None, (0, 0, 1), []) where either side measured the
    reference step in fewer than ``MIN_RUNS`` runs."""
    if len(best.references) < MIN_RUNS or len(old.references) < MIN_RUNS:
        return None, (0.0, 0.0, 1.0), []
    machine = compare(
        "machine: the reference step, today vs baseline",
        best.references,
        old.references,
        threshold,
        confidence,
    )
    betas = sensitivity_interval(best, old, confidence=confidence)
    speeds = [
        compare(
            "best, today vs baseline, at the same machine speed",
            at_machine_speed(best, beta),
            at_machine_speed(old, beta),
            threshold,
            confidence,
        )
        for beta in betas
    ]
    return machine, betas, speeds


def _decide(
    best_vs: Comparison,
    corrected: Sequence[Comparison],
    moved_vs: Comparison | None,
    threshold: float,
) -> tuple[str, Comparison]:
    """The overall verdict and the comparison it rests on (see ``conclude``): ``corrected`` are
    today's best vs the baseline's at the same machine speed, at the sensitivity's estimate and
    at the ends of its interval, where it counts (else empty)."""
    gate = corrected[0] if corrected else best_vs

    def slower(c: Comparison) -> bool:
        return c.ratio < 1 - threshold and c.high < 1

    def faster(c: Comparison) -> bool:
        return _faster(c, threshold)

    def within(c: Comparison) -> bool:
        return 1 - threshold <= c.low and c.high <= 1 + threshold

    if slower(best_vs) and all(c.ratio < 1 - threshold for c in corrected):
        verdict = REGRESSION
    elif moved_vs is not None and faster(moved_vs):
        verdict, gate = MOVED, moved_vs
    elif faster(best_vs) and all(c.ratio > 1 + threshold for c in corrected):
        verdict = IMPROVED
    elif all(within(c) for c in corrected or [best_vs]):
        verdict = SAME  # surely no material change (at the same machine speed, where measured)
    else:
        verdict = AMBIGUOUS  # a change beyond the threshold can be neither shown nor ruled out
    return verdict, gate


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
