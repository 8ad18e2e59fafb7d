"""Coverage by kind over every record at once, each judged again by the code as it is now.

    python benchmarks/coverage_pooled.py [RECORD ...] [--probe-windows N] [--json PATH]

One record of ``benchmarks/coverage_by_kind.py`` holds 24 runs of a kind: too few to tell 90%
from 95% (a 95% interval that holds exactly still covers 21 of 24 or fewer in one record of 8),
and its runs share their rounds, so one round whose level moved takes several with it. Pooling
the records gives each kind about six times the runs, from half hours of other levels on the
machine. Each record's runs are judged again here (``--rejudge``: measure nothing), as a first
invocation and with the earlier rounds as history, at search time and, where the record
re-validated, as re-validated means; then pooled by whether a core was kept busy (``busy-core``
in the record's name). Printed per kind: covered of all, the Clopper-Pearson 95% interval, the
median over runs of the half-width against what its record's kind spread requires, and runs
called unstable.

The records pooled by default are those of ``benchmarks/data/`` whose control runs all timed the
serial probe (from ``coverage_by_kind-2026-11-27-*-serial-probe`` on), and the compute probe for as
many windows as a study does (``noise.probe_windows``: 15 on the CPU; ``--probe-windows 5`` pools
the records from before, which timed 5), so that the code judges them with every figure it reads
now: without the serial probe, a Python-bound run takes the compute probe's spread. The earlier ones
also ran 6 rounds (one of them on another machine). Records of ``--pairs`` are left out: they
judge a mean of two processes, as a compiled trial is judged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from coverage_by_kind import (  # noqa: E402
    KINDS,
    _judged,
    _revalidated,
    _spread,
    configurations,
    counted,
    half_width,
)

from search.config.compose import compose_config, load_settings  # noqa: E402


def measured_with(record: Path, probe_windows: int) -> bool:
    """Whether every control run of ``record`` timed the serial probe, and the compute probe for
    ``probe_windows`` windows, and its configurations were measured once each, as a study measures
    an eager trial (not ``--pairs``)."""
    runs = json.loads(record.read_text()).get("runs", [])
    controls = [x["metrics"] for x in runs if x["config"] is None]
    return (
        bool(controls)
        and not any(x.get("second") for x in runs)
        and all(
            "serial_probe_throughput" in m and m.get("probe_n_windows") == probe_windows
            for m in controls
        )
    )


def records_measured_with(probe_windows: int) -> list[Path]:
    """The records whose control runs timed the probes as a study with ``probe_windows`` does."""
    return [
        p
        for p in sorted((HERE / "data").glob("coverage_by_kind-*.json"))
        if measured_with(p, probe_windows)
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="*", type=Path)
    parser.add_argument(
        "--probe-windows",
        type=int,
        help="with no records: those whose compute probe ran this many windows "
        "(default: a study's, noise.probe_windows)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    settings = load_settings(compose_config(["+space=llm"]))
    args.records = args.records or records_measured_with(
        args.probe_windows or settings.noise.probe_windows
    )
    tables: dict[str, dict[str, Any]] = {}
    for history in (False, True):
        for column, table in judged_tables(args.records, history).items():
            tables[f"{column}{', history' if history else ''}"] = table
    print(f"{len(args.records)} records: {', '.join(r.name for r in args.records)}")
    for column, table in tables.items():
        print(f"\n{column}:")
        for kind, s in table.items():
            print(
                f"  {kind:9s} covered {s['covered']}/{s['n']} = {s['coverage']:.1%} "
                f"[{s['ci_low']:.1%}, {s['ci_high']:.1%}]; half-width {s['width_ratio']:.2f}x "
                f"what the spread requires (median); unstable {s['unstable']}"
            )
    if args.json:
        args.json.write_text(json.dumps({"records": [r.name for r in args.records], **tables}))
    return 0


def judged_tables(records: list[Path], history: bool) -> dict[str, dict[str, Any]]:
    """Coverage and median width ratio of ``records`` judged again, by column (load, when) and
    kind; with ``history``, each round with the earlier rounds' control runs as history."""
    settings = load_settings(compose_config(["+space=llm"]))
    configs = configurations(KINDS)
    z = float(stats.norm.ppf(0.5 + settings.measure.confidence / 2))
    rows: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        runs = json.loads(record.read_text())["runs"]
        load = "busy core" if "busy-core" in record.name else "idle"
        for when, mine in (
            ("search time", _judged(runs, configs, settings, history)),
            ("re-validated", _revalidated(runs, configs, settings, history)),
        ):
            rows.setdefault(f"{load}, {when}", []).extend(_with_width(mine, z))
    return {column: _pooled(mine) for column, mine in rows.items()}


def _with_width(rows: list[dict[str, Any]], z: float) -> list[dict[str, Any]]:
    """Each row with its half-width over what its kind's spread in its own record requires."""
    out = []
    for kind in KINDS:
        mine = [r for r in rows if r["config"]["kind"] == kind]
        spread = _spread(mine) if mine else 0.0
        for r in mine:
            ratio = half_width(r) / (z * spread) if spread else float("nan")
            out.append({**r, "width_ratio": ratio})
    return out


def _pooled(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    table = {}
    for kind in KINDS:
        mine = [r for r in rows if r["config"]["kind"] == kind]
        if not mine:
            continue
        table[kind] = {
            **counted(mine),
            "width_ratio": float(np.nanmedian([r["width_ratio"] for r in mine])),
        }
    return table


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
