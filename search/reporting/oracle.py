"""The oracle view: for each knob and each of its values, the best stable configuration with it.

"Best" is as the recommendation ranks: the highest lower bound of the throughput interval, among
stable complete configurations within the SLO, on their final figures (re-validated where they
were). A value no stable configuration reached shows as not measured, one whose stable
configurations all break the SLO as over it. Read a panel as "had I fixed
this knob at this value and tuned everything else, this is the best the study found": the gap
between values is what getting that knob right is worth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from search.core.metrics import METRICS
from search.core.records import COMPLETE, TrialRecord, value_text
from search.reporting.report import knobs_text, si
from search.reporting.results import recommend
from search.space.params import IntParam, Param

__all__ = [
    "MAX_LISTED",
    "OracleRow",
    "oracle",
    "oracle_lines",
    "oracle_values",
    "write_oracle_plot",
]


@dataclass(frozen=True)
class OracleRow:
    knob: str
    value: Any
    best: TrialRecord | None
    """The best stable configuration with ``knob == value`` (None: none measured, or none within
    the SLO)."""
    stable_count: int = 0
    """Stable configurations measured with ``knob == value``, within the SLO or not."""


def oracle(
    history: Sequence[TrialRecord],
    knobs: Mapping[str, Sequence[Any] | None],
    slo: Mapping[str, float],
) -> list[OracleRow]:
    """A row per knob and value (``knobs``: each searched knob's values, None for a continuous
    range: the values measured). ``history`` with its final verdicts
    (``search.revalidation.candidates.with_revalidation``)."""
    stable = [r for r in history if r.state == COMPLETE and r.stable]
    rows = []
    for knob, values in knobs.items():
        listed = list(values) if values is not None else sorted({r.config[knob] for r in stable})
        for value in listed:
            with_value = [r for r in stable if r.config.get(knob) == value]
            rows.append(OracleRow(knob, value, recommend(with_value, slo), len(with_value)))
    return rows


MAX_LISTED = 16
"""An int knob with more values than this shows only the values measured."""


def oracle_values(param: Param) -> list[Any] | None:
    """The values the oracle lists for a searched knob: all of a categorical, a bool or a short
    int range; None (the values measured) for a float or a long int range."""
    if isinstance(param, IntParam) and param.count() > MAX_LISTED:
        return None  # counted, never listed: a range may hold billions
    values = param.values()
    return values if values is not None and len(values) <= MAX_LISTED else None


def oracle_lines(
    rows: Sequence[OracleRow], knob_names: Sequence[str], unit: str, shown: Sequence[str] = ()
) -> list[str]:
    """The oracle as the summary prints it: per knob, each value's best, with its ``shown``
    figures (the other objectives) and what the rest of its configuration was."""
    lines = ["best stable configuration for each value of each knob (the oracle view):"]
    if not rows:
        return [*lines, "  none: no stable configuration was measured"]
    for knob in dict.fromkeys(r.knob for r in rows):
        lines.append(f"  {knob}:")
        for r in (row for row in rows if row.knob == knob):
            if r.best is None:
                lines.append(f"    {value_text(r.value)}: {_none_because(r)}")
                continue
            m = r.best.metrics
            others = [k for k in knob_names if k != knob]
            figures = "".join(
                f", {METRICS[k].label} {m[k]:{METRICS[k].fmt}} {METRICS[k].unit}"
                for k in shown
                if k in m
            )
            lines.append(
                f"    {value_text(r.value)}: {si(m['throughput'])} [{si(m['throughput_ci_low'])}, "
                f"{si(m['throughput_ci_high'])}] {unit}/s{figures}, #{r.best.number}"
                + (f" ({knobs_text(r.best.config, others)})" if others else "")
            )
    return lines


def _none_because(row: OracleRow) -> str:
    if row.stable_count:
        return f"no stable configuration within the SLO ({row.stable_count} stable measured)"
    return "no stable configuration measured"


def write_oracle_plot(path: Path, rows: Sequence[OracleRow], unit: str, title: str) -> None:
    """``oracle.png``: a panel per knob, the best throughput (with its interval) at each value.
    Nothing is written for no rows (every knob continuous and nothing stable)."""
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knobs = list(dict.fromkeys(r.knob for r in rows))
    columns = min(len(knobs), 4)
    lines = math.ceil(len(knobs) / columns)
    fig, axes = plt.subplots(
        lines,
        columns,
        figsize=(3.2 * columns + 0.8, 3.4 * lines + 0.3),
        dpi=120,
        squeeze=False,
        sharey=True,
    )
    for ax in axes.flat[len(knobs) :]:
        ax.set_visible(False)
    for ax, knob in zip(axes.flat, knobs, strict=False):
        _draw_knob(ax, knob, [r for r in rows if r.knob == knob])
    for row in axes:
        row[0].set_ylabel(f"best stable throughput ({unit}/s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _draw_knob(ax: Any, knob: str, mine: Sequence[OracleRow]) -> None:
    """One panel: the best stable throughput at each of ``knob``'s values, with its interval and
    the trial it came from; a value with no stable configuration says so."""
    labels = [value_text(r.value) for r in mine]
    x = list(range(len(mine)))
    y = [r.best.metrics["throughput"] if r.best else math.nan for r in mine]
    err = [
        [
            r.best.metrics["throughput"] - r.best.metrics["throughput_ci_low"] if r.best else 0
            for r in mine
        ],
        [
            r.best.metrics["throughput_ci_high"] - r.best.metrics["throughput"] if r.best else 0
            for r in mine
        ],
    ]
    ax.errorbar(x, y, yerr=err, fmt="o", capsize=4, color="tab:blue")
    for xi, r in zip(x, mine, strict=True):
        if r.best is None:
            ax.annotate(
                "over the SLO" if r.stable_count else "not measured",
                (xi, 0),
                ha="center",
                fontsize=7,
                color="gray",
                xycoords=("data", "axes fraction"),
                xytext=(0, 6),
                textcoords="offset points",
            )
        else:
            ax.annotate(
                f"#{r.best.number}",
                (xi, y[xi]),
                textcoords="offset points",
                xytext=(5, 3),
                fontsize=7,
            )
    ax.set_xticks(x, labels)
    ax.set_xlim(-0.5, len(mine) - 0.5)
    ax.set_xlabel(knob)
    ax.grid(alpha=0.3)
