"""Do the tool's intervals cover the long-run mean for every kind of configuration, here?

    python benchmarks/coverage_by_kind.py [--rounds 6] [--busy-core] [--bursts] [--pairs]
                                          [--revalidate K] [--probe-windows N] [--json PATH]
    python benchmarks/coverage_by_kind.py --rejudge RECORD [--history] [--without-serial-probe]
                                          [--first-runs]

A ground truth of known kinds (``benchmarks/kinds.py``): steady (waits), overhead-bound (Python),
compute-bound (real matrix products) and stalling (2% of micro-batches 10x), each at batch 8 and
32 in micro-batches of 1 and at batch 32 in micro-batches of 8, measured on this machine in fresh
worker processes with the tool's default measurement settings. Each round is one study's worth,
scheduled as the tool schedules one: 2 control runs (the steady kind at batch 8, micro-batch 1,
each timing the probes), every configuration once in a random order with a control run
after the sixth, a control run at the end. Each run's interval spanning runs and its stability
verdict come from its round's noise floor alone (``search.stability.judge.assess``).

The long-run mean of a configuration is the mean of its runs in the other rounds (leave one out),
so a miss can be the reference's: with 6 rounds its standard error is the between-process spread
over the square root of 5. Printed per kind: coverage at the nominal level with its
Clopper-Pearson 95% interval, the median half-width against what the kind's between-process
spread requires (the normal quantile times the spread of its runs), and how often a run was
called unstable. ``--busy-core`` keeps one core spinning in another process throughout.
``--rejudge`` judges the runs of a record again (it keeps every run, control runs included;
``--without-serial-probe`` leaves out the serial probe of each control run, so that the same runs
are judged as they were before the serial class) and
``--history`` judges each round with the control runs of the rounds before it as the machine's
history, each an invocation of another study (``search.storage.machine_runs``), as a study is judged
on a machine that has run others (or itself, nightly) before.
``--bursts`` copies memory in bursts in another process throughout. As a study does, a run that
fails the stall test first (judged against its round's control runs so far) is followed by one
more control run, and one that fails the window-dispersion test by a second fresh process of it,
the two judged together; after the round's last control run, so is one that fails it against all
of the round's control runs and has no second process yet, as the end of a study measures
(``search.study.late_checks``) (``search.stability.judge``: unstable only where both are;
``--without-confirmation`` judges a record's runs without those second processes).
``--probe-windows N`` times the compute probe for N windows in each control run (by default a
study's ``noise.probe_windows``: 15 on the CPU, 5 before); ``--probe-head`` judges such a record
again by the first 5 windows of each of those probes, the same processes as a 5-window probe.
``--pairs`` measures each configuration in two fresh processes in a row, as a compiled trial is, and
judges the mean of the two with a floor that also holds the other configurations' pairs;
``--rejudge R --first-runs`` judges such a record's first runs alone, as single runs (the same
processes, the same half hour).
``--revalidate K`` re-validates every configuration of a round as a study re-validates its
candidates: K more fresh processes each, all in one random order after the configurations and before
the round's last control run, each with re-validation's time budget; their mean is judged as a
re-validated candidate is (``search.stability.leave_one_out``: the other configurations' fresh runs
in the floor, not its own) and printed as a second table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

HERE = Path(__file__).resolve().parent
# The worker processes import the workload by name: put this folder on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p
)
sys.path[:0] = [str(HERE), str(HERE.parent)]

from coverage import clopper_pearson  # noqa: E402

from search.analysis.noise_floor import NoiseFloor, RunFigures  # noqa: E402
from search.config.compose import compose_config, load_settings  # noqa: E402
from search.core.records import COMPLETE  # noqa: E402
from search.execution.figures import trial_metrics  # noqa: E402
from search.execution.isolation import run_isolated  # noqa: E402
from search.execution.trial import TrialRequest  # noqa: E402
from search.measurement.host_load import cpu_mark, others_busy_cores  # noqa: E402
from search.revalidation.pooling import Pooled  # noqa: E402
from search.stability.judge import DISPERSED, Yardstick, assess  # noqa: E402
from search.stability.leave_one_out import judged_candidates  # noqa: E402

KINDS = ("steady", "overhead", "compute", "stalling")
SHAPES = ((8, 1), (32, 1), (32, 8))
CONTROL = {"kind": "steady", "batch_size": 8, "micro_batch_size": 1, "precision": "fp32"}
PROBE_WINDOWS = [TrialRequest.probe_windows]
"""Windows of the compute probe in each control run (``--probe-windows``; by default a study's
``noise.probe_windows``)."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy-core", action="store_true", help="keep one core spinning")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--rejudge", type=Path, help="judge the runs of an earlier record again; measure nothing"
    )
    parser.add_argument(
        "--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds measured"
    )
    parser.add_argument(
        "--bursts", action="store_true", help="copy memory in bursts in another process"
    )
    parser.add_argument(
        "--pairs",
        action="store_true",
        help="measure each configuration in two fresh processes in a row, as a compiled trial",
    )
    parser.add_argument(
        "--revalidate",
        type=int,
        default=0,
        metavar="K",
        help="re-validate every configuration of a round in K more fresh processes",
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help="judge each round with the earlier rounds' control runs as the machine's history",
    )
    parser.add_argument(
        "--without-serial-probe",
        action="store_true",
        help="with --rejudge: leave out the control runs' serial probes, as judged before them",
    )
    parser.add_argument(
        "--without-confirmation",
        action="store_true",
        help="with --rejudge: leave out the second processes of dispersed runs",
    )
    parser.add_argument(
        "--probe-head",
        action="store_true",
        help="with --rejudge: judge by the first 5 windows of each control run's longer probe",
    )
    parser.add_argument(
        "--first-runs",
        action="store_true",
        help="with --rejudge: judge a --pairs record's first runs alone, as single runs",
    )
    parser.add_argument(
        "--probe-windows",
        type=int,
        help="windows of the compute probe in each control run (default: a study's, "
        "noise.probe_windows)",
    )
    args = parser.parse_args(argv)
    settings = load_settings(compose_config(["+space=llm"]))
    PROBE_WINDOWS[0] = args.probe_windows or settings.noise.probe_windows
    configs = configurations(args.kinds)
    started = time.time()
    if args.rejudge:
        runs = _rejudged(args)
    else:
        # A stopped benchmark must not leave its neighbours spinning: SIGTERM (``kill``) runs
        # the ``finally`` below as Ctrl-C does.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        neighbours = [
            *([_spin()] if args.busy_core else []),
            *([_bursts()] if args.bursts else []),
        ]
        try:
            runs = _rounds(configs, settings, args, random.Random(args.seed))
        finally:
            for neighbour in neighbours:
                neighbour.kill()
    rows = _judged(runs, configs, settings, args.history)
    summary = _by_kind(rows, settings.measure.confidence)
    revalidated = _revalidated(runs, configs, settings, args.history)
    summary_revalidated = _by_kind(revalidated, settings.measure.confidence)
    measured = (
        f"the runs of {args.rejudge}"
        + (" without their serial probes" if args.without_serial_probe else "")
        + (" without the second processes of dispersed runs" if args.without_confirmation else "")
        + (" by the first 5 windows of their probes" if args.probe_head else "")
        + (", the first of each pair alone" if args.first_runs else "")
        if args.rejudge
        else f"{args.rounds} rounds, {(time.time() - started) / 60:.1f} min, busy core: "
        f"{args.busy_core}"
    )
    print(f"\n{measured}; with the earlier rounds as history: {args.history}")
    _print(summary)
    if revalidated:
        print("re-validated (the mean of each configuration's fresh processes):")
        _print(summary_revalidated)
    if args.json:
        record = {
            "summary": summary,
            "rows": rows,
            "summary_revalidated": summary_revalidated,
            "rows_revalidated": revalidated,
            "runs": runs,
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


def _rejudged(args) -> list[dict[str, Any]]:
    """The runs of the record ``args.rejudge``, less what the flags leave out."""
    runs = json.loads(args.rejudge.read_text())["runs"]
    if args.without_confirmation:
        runs = [run for run in runs if not run.get("confirm")]
    if args.first_runs:  # the same processes as the pairs, judged as a study judges one run
        runs = [run for run in runs if not run.get("second")]
    if args.probe_head:
        for run in runs:
            run["metrics"] |= _head_as_probe(run["metrics"])
    if args.without_serial_probe:
        for run in runs:
            run["metrics"] = {
                k: v for k, v in run["metrics"].items() if not k.startswith("serial_probe")
            }
    return runs


def configurations(kinds) -> list[dict[str, Any]]:
    """The ground truth's configurations of ``kinds``: each at every shape of ``SHAPES``, fp32."""
    return [
        {"kind": k, "batch_size": b, "micro_batch_size": m, "precision": "fp32"}
        for k in kinds
        for b, m in SHAPES
    ]


def _head_as_probe(metrics: dict[str, Any]) -> dict[str, Any]:
    """A control run's figures of the first windows of its compute probe (``probe_head_*``, timed
    where the probe ran longer than the tool's 5 windows) in place of the whole probe's."""
    head = "probe_head_"
    return {f"probe_{k[len(head) :]}": v for k, v in metrics.items() if k.startswith(head)}


def _print(summary) -> None:
    for kind, s in summary.items():
        print(
            f"{kind:9s} covered {s['covered']}/{s['n']} = {s['coverage']:.0%} "
            f"[{s['ci_low']:.0%}, {s['ci_high']:.0%}]; median half-width {s['half_width']:.1%}, "
            f"{s['width_ratio']:.2f}x the {s['spread']:.1%} spread requires; unstable "
            f"{s['unstable']}/{s['n']}"
        )


def _spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


BURSTS = """
import time
import numpy as np
source = np.ones(64 * 2**20 // 8)  # 64 MiB: beyond the caches
target = np.empty_like(source)
while True:
    for burst_s in (0.3, 0.7):
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            np.copyto(target, source)
        time.sleep(1.6 - burst_s)
"""
"""Memory copying in bursts beside the runs: 0.3 s, then 0.7 s, each followed by a pause that
makes up 1.6 s."""


def _bursts() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURSTS])


def _run(
    config: dict[str, Any], settings, probe: bool = False, again: bool = False
) -> dict[str, Any] | None:
    """One fresh process of ``config``; ``again``: a re-validation run, with its time budget."""
    measure = settings.measure
    if again:  # as ``search.study.driver.repeat_run`` budgets it
        budget_s = min(measure.max_time_s, settings.revalidate.max_time_s)
        measure = replace(measure, max_time_s=budget_s)
    request = TrialRequest(
        workload={"_target_": "kinds.Kinds"},
        config=config,
        device="cpu",
        seed=settings.seed,
        measure=measure,
        timeout_s=300.0,
        fidelity=False,
        count=False,
        probe_compute=probe,
        probe_windows=PROBE_WINDOWS[0],
    )
    mark = cpu_mark()
    result = run_isolated(request)
    if result.state != COMPLETE:
        print(f"  {config}: {result.state}: {result.failure}", flush=True)
        return None
    metrics = trial_metrics(result, settings.measure.confidence)
    others = others_busy_cores(mark) if probe else None
    if others is not None:  # as the study driver keeps it for a control run
        metrics["others_busy_cores"] = others
    return {"metrics": metrics, "time_s": time.time()}


def _rounds(configs, settings, args, rng: random.Random) -> list[dict[str, Any]]:
    """Every round's control runs and configuration runs, in the order they ran; with
    ``args.pairs`` each configuration twice in a row, as a compiled trial is measured."""
    out: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = list(range(len(configs)))
        rng.shuffle(order)
        half = len(order) // 2
        schedule = [None, None, *order[:half], None, *order[half:]]  # None: a control run
        fresh = [i for i in order for _ in range(args.revalidate)]
        rng.shuffle(fresh)  # one random order, as re-validation interleaves its runs
        for i in schedule:
            for second in (False, True) if args.pairs and i is not None else (False,):
                got = _run(CONTROL if i is None else configs[i], settings, probe=i is None)
                if got is None:
                    continue
                out.append({**got, "round": r, "config": i, "second": second})
                if i is not None and not second:
                    out += _settled(got, out, r, (configs[i], i, not args.pairs), settings)
        for i in fresh:
            got = _run(configs[i], settings, again=True)
            if got is not None:
                out.append({**got, "round": r, "config": i, "second": False, "again": True})
        got = _run(CONTROL, settings, probe=True)
        if got is not None:
            out.append({**got, "round": r, "config": None, "second": False})
        if not args.pairs:
            out += _dispersed_at_the_end(out, r, configs, settings)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return out


def _settled(got, out, round_: int, which, settings) -> list[dict[str, Any]]:
    """The runs a study adds after ``got`` to tell a burst on the machine from the configuration
    (``search.study.driver.StudyDriver._settled``): a control run where it fails the stall test
    first, then a second fresh process of it where it fails the dispersion test (``which``: the
    configuration, its index, and whether to: not where it has a second process already), each
    judged against its round's control runs so far."""
    config, i, confirm = which
    added: list[dict[str, Any]] = []
    if _fails_first("stalls", got, out, round_, settings):
        follow_up = _run(CONTROL, settings, probe=True)
        if follow_up is not None:
            added.append({**follow_up, "round": round_, "config": None, "second": False})
    if confirm and _fails_first("dispersion", got, [*out, *added], round_, settings):
        again = _run(config, settings)
        if again is not None:
            added.append({**again, "round": round_, "config": i, "second": False, "confirm": True})
    return added


def _dispersed_at_the_end(out, round_: int, configs, settings) -> list[dict[str, Any]]:
    """A second fresh process of each run of the round that fails the dispersion test first
    against all of the round's control runs and has none yet, as the end of a study measures
    (``search.study.late_checks``)."""
    again = {x["config"] for x in out if x["round"] == round_ and x.get("confirm")}
    added: list[dict[str, Any]] = []
    for x in out:
        first = x["round"] == round_ and x["config"] is not None and not x.get("again")
        if (
            not first
            or x["config"] in again
            or not _fails_first("dispersion", x, out, round_, settings)
        ):
            continue
        got = _run(configs[x["config"]], settings)
        if got is not None:
            added.append(
                {**got, "round": round_, "config": x["config"], "second": False, "confirm": True}
            )
    return added


def _fails_first(test: str, got, out, round_: int, settings) -> bool:
    """Whether ``got`` fails ``test`` first (its verdict's reason starts so), judged against its
    round's control runs so far."""
    controls = [_figures(x) for x in out if x["round"] == round_ and x["config"] is None]
    yardstick = Yardstick(
        NoiseFloor.estimate(controls), settings.stable, settings.measure.confidence
    )
    _, verdict = assess(got["metrics"], got["time_s"], yardstick)
    return not verdict.stable and verdict.reason.startswith(test)


def _judged(runs, configs, settings, history: bool) -> list[dict[str, Any]]:
    """Each configuration's run (or pair of runs) with its interval and verdict from its round's
    floor (with ``history``, also from the earlier rounds' control runs, each round a session of
    its own; with pairs, also from the other configurations' pairs of its round, as a study's
    floor holds its compiled trials'), and the long-run mean of the other rounds."""
    confidence, rows = settings.measure.confidence, []
    measured = _measured(runs)
    confirmed = {(x["round"], x["config"]): x for x in runs if x.get("confirm")}
    for r in sorted({run["round"] for run in runs}):
        controls = _controls(runs, r)
        # with history, the earlier rounds are other invocations on this machine, as a study's
        # floor reads them from the runs directory (``search.storage.machine_runs``)
        earlier = [(True, _controls(runs, q)) for q in range(r)] if history else []
        for (round_, i), (first, second) in measured.items():
            if round_ != r:
                continue
            others = [_mean(m) for (q, j), m in measured.items() if j == i and q != r]
            if len(others) < 2:
                continue
            pairs = [
                tuple(_figures(x) for x in m)
                for (q, j), m in measured.items()
                if second is not None and j != i and q == r and m[1] is not None
            ]
            floor = NoiseFloor.estimate(controls, pairs, earlier)
            extra = None if second is None else {"state": COMPLETE, **second}
            if (r, i) in confirmed:
                extra = {"state": COMPLETE, "why": DISPERSED, **confirmed[(r, i)]}
            spanned, verdict = assess(
                first["metrics"],
                first["time_s"],
                Yardstick(floor, settings.stable, confidence),
                second=extra,
            )
            truth = float(np.mean(others))
            low, high = spanned["throughput_ci_low"], spanned["throughput_ci_high"]
            rows.append(
                {
                    "round": r,
                    "config": configs[i],
                    "throughput": spanned["throughput"]
                    if (r, i) in confirmed
                    else _mean((first, second)),
                    "host_busy": first["metrics"].get("host_busy"),
                    "interval": [low, high],
                    "long_run_mean": truth,
                    "covered": low <= truth <= high,
                    "stable": verdict.stable,
                    "reason": verdict.reason,
                    "floor": floor.line(),
                }
            )
    return rows


def _revalidated(runs, configs, settings, history: bool) -> list[dict[str, Any]]:
    """Each re-validated configuration's mean of its fresh processes, judged as a study judges
    its re-validated candidates (``judged_candidates``: the other configurations' fresh runs in
    the floor, not its own), with the long-run mean of its search-time runs in the other rounds
    (as ``_judged``'s)."""
    measured, rows = _measured(runs), []
    for r in sorted({run["round"] for run in runs}):
        fresh: dict[int, list[dict[str, Any]]] = {}
        for x in runs:
            if x["round"] == r and x.get("again"):
                fresh.setdefault(x["config"], []).append(x)
        stored = {
            i: Pooled(xs[0]["metrics"], True, "", tuple(_figures(x) for x in xs))
            for i, xs in fresh.items()
            if len(xs) >= 2
        }
        earlier = [(True, _controls(runs, q)) for q in range(r)] if history else []
        _, judged = judged_candidates(_controls(runs, r), [], stored, settings, earlier)
        for i, pooled in judged.items():
            others = [_mean(m) for (q, j), m in measured.items() if j == i and q != r]
            if len(others) < 2:
                continue
            truth = float(np.mean(others))
            low, high = pooled.metrics["throughput_ci_low"], pooled.metrics["throughput_ci_high"]
            rows.append(
                {
                    "round": r,
                    "config": configs[i],
                    "throughput": pooled.metrics["throughput"],
                    "interval": [low, high],
                    "long_run_mean": truth,
                    "covered": low <= truth <= high,
                    "stable": pooled.stable,
                    "reason": pooled.reason,
                }
            )
    return rows


def _controls(runs, round_: int) -> list[RunFigures]:
    """The control runs of one round, a session of their own."""
    return [
        replace(_figures(x), session=str(x["round"]))
        for x in runs
        if x["round"] == round_ and x["config"] is None
    ]


def _measured(runs) -> dict[tuple[int, int], tuple[dict[str, Any], dict[str, Any] | None]]:
    """(round, configuration): its first run and its second (None where it had none)."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for x in runs:
        if x["config"] is not None and not x.get("again") and not x.get("confirm"):
            out.setdefault((x["round"], x["config"]), []).append(x)
    return {k: (v[0], v[1] if len(v) > 1 else None) for k, v in out.items()}


def _figures(x: dict[str, Any]) -> RunFigures:
    return RunFigures.of(x["metrics"], x["time_s"])


def _mean(measured) -> float:
    """The mean throughput of a configuration's run or pair of runs in one round."""
    return float(np.mean([x["metrics"]["throughput"] for x in measured if x is not None]))


def _by_kind(rows, confidence: float) -> dict[str, dict[str, Any]]:
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    summary = {}
    for kind in KINDS:
        mine = [r for r in rows if r["config"]["kind"] == kind]
        if not mine:
            continue
        half = statistics.median(half_width(r) for r in mine)
        spread = _spread(mine)
        summary[kind] = {
            **counted(mine),
            "half_width": half,
            "spread": spread,
            "width_ratio": half / (z * spread) if spread else float("nan"),
        }
    return summary


def counted(rows) -> dict[str, Any]:
    """How many of ``rows`` covered, with the Clopper-Pearson interval, and were unstable."""
    covered = sum(r["covered"] for r in rows)
    low, high = clopper_pearson(covered, len(rows))
    return {
        "covered": covered,
        "n": len(rows),
        "coverage": covered / len(rows),
        "ci_low": low,
        "ci_high": high,
        "unstable": sum(not r["stable"] for r in rows),
    }


def half_width(row) -> float:
    """A row's interval half-width, in log throughput."""
    return float(np.log(row["interval"][1] / row["interval"][0]) / 2)


def _spread(rows) -> float:
    """Between-process spread of log throughput, pooled over the kind's configurations."""
    by_config: dict[str, list[float]] = {}
    for r in rows:
        by_config.setdefault(json.dumps(r["config"], sort_keys=True), []).append(r["throughput"])
    ss = sum(float(np.sum((np.log(v) - np.log(v).mean()) ** 2)) for v in by_config.values())
    df = sum(len(v) - 1 for v in by_config.values())
    return float(np.sqrt(ss / df)) if df else float("nan")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
