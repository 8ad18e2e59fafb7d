"""What the between-session prior buys and costs: coverage against width as it varies.

    python benchmarks/session_prior_tradeoff.py [RECORDS] [--priors 0 0.5 1 2 3] [--json R]
                                                [--png P]

At a study's first invocation on a machine, the variance of the session's level about the machine's
long-run level is not measured: ``NoiseFloor.session_prior`` stands for it, a multiple of the
class's between-run spread (``search.analysis.noise_floor.SESSION_PRIOR``). This judges the runs of
the coverage records again (as ``benchmarks/coverage_pooled.py`` does; by default the records whose
control runs timed the serial probe and a compute probe of 5 windows) with each prior in turn, as a
first invocation, and prints and draws, per kind, idle and with a core busy, at search time and
re-validated: the share of intervals that covered the long-run mean, against their median half-width
over what the kind's spread requires. The issue's goals (90% covered, at most 1.5x) are drawn as
lines. Nothing is measured; the records are read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from coverage_by_kind import KINDS  # noqa: E402
from coverage_pooled import judged_tables, records_measured_with  # noqa: E402

from search.analysis.noise_floor import SESSION_PRIOR, NoiseFloor  # noqa: E402

PROBE_WINDOWS_BEFORE = 5
"""The records judged by default: those whose compute probe ran 5 windows (8 records, 4 idle and 4
with a core busy), the most there are of one kind of measurement."""
COVERAGE_GOAL, WIDTH_GOAL = 0.90, 1.5
"""The issue's goals: at least 90% covered at 95% nominal, at most 1.5x the width needed."""


@contextmanager
def session_prior(prior: float) -> Iterator[None]:
    """Every floor estimated inside the block takes ``prior`` as its session prior."""
    original = NoiseFloor.__dict__["estimate"]

    def with_prior(cls: type[NoiseFloor], *args: Any, **kwargs: Any) -> NoiseFloor:
        return replace(original.__func__(cls, *args, **kwargs), session_prior=prior)

    NoiseFloor.estimate = classmethod(with_prior)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        NoiseFloor.estimate = original  # type: ignore[method-assign]


def judged(records: list[Path], prior: float) -> dict[str, dict[str, Any]]:
    """Coverage and median width ratio by column (load, when) and kind, at ``prior``, as a first
    invocation."""
    with session_prior(prior):
        return judged_tables(records, history=False)


def draw(tables: dict[float, dict[str, dict[str, Any]]], png: Path) -> None:
    """One panel per time of judging; a line per kind and load through the priors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    priors = sorted(tables)
    colours = dict(zip(KINDS, ("tab:blue", "tab:orange", "tab:red", "tab:green"), strict=True))
    for panel, when in zip(panels, ("search time", "re-validated"), strict=True):
        for load, style in (("idle", "-o"), ("busy core", "--s")):
            for kind in KINDS:
                points = [tables[p][f"{load}, {when}"][kind] for p in priors]
                xs = [s["width_ratio"] for s in points]
                ys = [100 * s["coverage"] for s in points]
                panel.plot(xs, ys, style, color=colours[kind], label=f"{kind}, {load}", ms=4)
                if kind == "steady" and load == "idle":
                    for p, x, y in zip(priors, xs, ys, strict=True):
                        panel.annotate(
                            f"{p:g}x", (x, y), textcoords="offset points", xytext=(4, -10)
                        )
        panel.axhline(100 * COVERAGE_GOAL, color="grey", lw=0.8)
        panel.axvline(WIDTH_GOAL, color="grey", lw=0.8)
        panel.set_title(f"{when}, first invocation")
        panel.set_xlabel("median half-width / what the spread requires")
    panels[0].set_ylabel("intervals that covered the long-run mean, %")
    panels[1].legend(fontsize=7, ncol=2, loc="lower right")
    figure.suptitle(
        f"The session prior from {min(priors):g}x to {max(priors):g}x the between-run spread "
        f"(the tool's: {SESSION_PRIOR:g}x); goals: {COVERAGE_GOAL:.0%} covered, "
        f"at most {WIDTH_GOAL:g}x"
    )
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", type=Path)
    parser.add_argument("--priors", nargs="+", type=float, default=[0.0, 0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    args.records = args.records or records_measured_with(PROBE_WINDOWS_BEFORE)
    tables = {prior: judged(args.records, prior) for prior in args.priors}
    print(f"{len(args.records)} records: {', '.join(r.name for r in args.records)}")
    for prior, columns in tables.items():
        print(f"\nsession prior {prior:g}x:")
        for column, table in columns.items():
            cells = ", ".join(
                f"{kind} {s['covered']}/{s['n']} {s['width_ratio']:.2f}x"
                for kind, s in table.items()
            )
            print(f"  {column:25s} {cells}")
    if args.json:
        record = {"records": [r.name for r in args.records], "priors": tables}
        args.json.write_text(json.dumps(record, indent=1))
    if args.png:
        draw(tables, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
