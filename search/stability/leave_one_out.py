"""The leave-one-out policy: each re-validated candidate judged against a floor without its own
runs, so that an erratic candidate cannot set its own yardstick, and the floor that figures are
reported with made of the runs of stable candidates only (a throttled or erratic one says nothing
about the machine)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.revalidation.pooling import Pooled
from search.stability.judge import Yardstick, assess_pooled

if TYPE_CHECKING:
    from search.config.settings import Settings

__all__ = ["judged_candidates"]


def judged_candidates(
    controls: Sequence[RunFigures],
    pairs: Sequence[tuple[RunFigures, RunFigures]],
    stored: Mapping[int, Pooled],
    settings: Settings,
    history: Sequence[tuple[bool, Sequence[RunFigures]]] = (),
) -> tuple[NoiseFloor, dict[int, Pooled]]:
    """The noise floor and the re-validated candidates (``stored``, by trial number) judged
    against it, from the control runs and the trials' pairs of fresh processes (and ``history``,
    other studies' sessions on this machine: ``NoiseFloor.estimate``).

    Each candidate is judged against a floor without its own runs, so that an erratic candidate
    cannot set its own yardstick; the floor that figures are reported with holds only the
    replicates of candidates judged stable (a throttled or erratic one says nothing about the
    machine).
    """
    groups = {n: p.runs for n, p in stored.items() if p.stable and len(p.runs) >= 2}
    confidence = settings.measure.confidence
    verdicts = {}
    for number, runs in groups.items():
        others = [g for m, g in groups.items() if m != number]
        verdicts[number] = assess_pooled(
            stored[number].metrics,
            runs,
            Yardstick(
                NoiseFloor.estimate(controls, [*pairs, *others], history),
                settings.stable,
                confidence,
            ),
        )[1]
    floor = NoiseFloor.estimate(
        controls, [*pairs, *(g for n, g in groups.items() if verdicts[n].stable)], history
    )
    reported = Yardstick(floor, settings.stable, confidence)
    judged = {}
    for number, pooled in stored.items():
        if number not in verdicts:
            judged[number] = pooled  # failed or throttled: its stored verdict stands
            continue
        metrics, _ = assess_pooled(pooled.metrics, pooled.runs, reported)
        verdict = verdicts[number]
        judged[number] = Pooled(metrics, verdict.stable, verdict.reason, pooled.runs)
    return floor, judged
