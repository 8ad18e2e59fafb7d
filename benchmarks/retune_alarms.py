"""False alarms and detection of ``python -m search retune``, on this machine.

A chain of runs of one study, each re-tune compared with the run before it
(``retune.baseline=last``, as a nightly job does):

- ``--unchanged N``: a tuning, then N re-tunes of the same workload. Exit 3 is a false alarm.
- ``--slower F --trials N``: a tuning at factor 1, then N times a re-tune of the workload made F
  times slower (compared with a run at factor 1: exit 3 is a detection) followed by one back at
  factor 1 (compared with the slower one: it got faster, so exit 3 there is a false alarm too).

Neighbouring re-tunes of a chain share a run (one's today is the next one's baseline), so their
outcomes are not quite independent: the Clopper-Pearson intervals printed treat them as if they
were, and are somewhat too narrow.

The workload (``tests/retune_space/slowdown.py``) does real compute (``--work matmul``, the
default), so the machine's own noise is in every figure, or sleeps (``--work sleep``): a workload
as steady as the operating system's timer, to show what the verdicts do when runs agree closely.
Measurement settings are short; the re-tune's own settings (``retune.confirm``,
``retune.processes``, ``retune.threshold``, the reference step) are the defaults unless given
after ``--``. Run it on an otherwise idle machine:

    python benchmarks/retune_alarms.py --unchanged 20
    python benchmarks/retune_alarms.py --slower 1.1 --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scipy import stats

REPO = Path(__file__).resolve().parents[1]

SETTINGS = [
    "--config-dir",
    str(REPO / "tests" / "retune_space"),
    "+space=slowdown",
    "device=cpu",
    "measure.warmup_s=0.2",
    "measure.window_s=0.1",
    "measure.min_windows=5",
    "measure.max_time_s=1.5",
    "study.n_trials=2",
    "study.sampler=random",
    "noise.budget=0",  # no control runs: the verdict rests on the confirmation runs
    "revalidate.processes=2",
    "revalidate.max_candidates=1",
    "retune.remeasure=0",
    "retune.n_trials=1",
]


WORK = {
    # real compute: 200 products of 128x128 matrices per micro-batch, the machine's own noise
    "matmul": ["+space.workload.work=matmul", "+space.workload.base=200"],
    # 40 ms of sleep per micro-batch: as steady as the operating system's timer, far steadier
    # than compute on this shared CPU (a stand-in for a device whose runs agree closely). Long,
    # so that the host's own work in the step stays a small part of it: that work runs slower
    # just after a sleep, by a factor that differs between processes (100 small operations took
    # 235-247 us back to back, 268-446 us after a 2 ms sleep), and at 4 ms a step's fresh
    # processes differed by up to 26%, at 40 ms by 2% at most
    "sleep": ["+space.workload.work=sleep", "+space.workload.base=40"],
}


def search(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "retune_space"), str(REPO)]),
    }
    return subprocess.run(
        [sys.executable, "-m", "search", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    low = stats.beta.ppf(0.025, k, n - k + 1) if k else 0.0
    high = stats.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    return float(low), float(high)


class Chain:
    """One study in a temporary runs_dir; each re-tune against the last run."""

    def __init__(self, runs_dir: str, work: str, extra: list[str]):
        self.common = [*SETTINGS, *WORK[work], *extra, f"runs_dir={runs_dir}"]
        self.runs_dir = Path(runs_dir)
        self.seconds: list[float] = []

    def tune(self, factor: float) -> None:
        result = search(*self.common, f"space.workload.factor={factor}")
        if result.returncode != 0:
            sys.exit(f"the tuning failed:\n{result.stdout}\n{result.stderr}")

    def retune(self, factor: float) -> tuple[int, str, dict]:
        t0 = time.monotonic()
        result = search("retune", *self.common, f"space.workload.factor={factor}")
        self.seconds.append(time.monotonic() - t0)
        if result.returncode not in (0, 3):
            sys.exit(f"a re-tune failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        reports = sorted((self.runs_dir / "slowdown-cpu" / "retune").glob("*.json"))
        report = json.loads(reports[-1].read_text())
        line = result.stdout.strip().splitlines()[-1]
        return result.returncode, line, report


BEST, ADJUSTED = "best, today vs baseline", "best, today vs baseline, at the same machine speed"


def ratio(report: dict, what: str) -> float:
    found = [c["ratio"] for c in report["comparisons"] if c["what"].startswith(what)]
    return found[0] if found else float("nan")


def spread(ratios: list[float]) -> str:
    finite = [r for r in ratios if r == r]
    if not finite:
        return "none"
    return f"median {statistics.median(finite):.3f}, range {min(finite):.3f}-{max(finite):.3f}"


def summary(label: str, codes: list[int], reports: list[dict]) -> str:
    hits = codes.count(3)
    low, high = clopper_pearson(hits, len(codes))
    verdicts = [r["verdict"] for r in reports]
    return (
        f"{label}: exit 3 in {hits}/{len(codes)} ({hits / len(codes):.0%}, 95% CI "
        f"[{low:.0%}, {high:.0%}]); verdicts "
        + ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(verdicts)))
        + f"; best ratio {spread([ratio(r, BEST) for r in reports])}; at the same machine speed "
        f"{spread([ratio(r, ADJUSTED) for r in reports])}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unchanged", type=int, default=0, help="re-tunes of an unchanged model")
    parser.add_argument("--slower", type=float, default=0.0, help="slowdown factor, e.g. 1.1")
    parser.add_argument("--trials", type=int, default=20, help="slowdowns to detect")
    parser.add_argument("--work", choices=sorted(WORK), default="matmul", help="the workload")
    parser.add_argument("extra", nargs="*", help="more overrides, after --")
    args = parser.parse_args()
    started = time.monotonic()
    lines = []
    if args.unchanged:
        with tempfile.TemporaryDirectory() as runs_dir:
            chain = Chain(runs_dir, args.work, args.extra)
            chain.tune(1.0)
            codes, reports = [], []
            for i in range(args.unchanged):
                code, line, report = chain.retune(1.0)
                codes.append(code)
                reports.append(report)
                print(f"unchanged {i + 1}: exit {code}: {line}", flush=True)
            lines.append(summary("unchanged, false alarms", codes, reports))
            lines.append(f"  a re-tune took {statistics.median(chain.seconds):.0f} s (median)")
    if args.slower:
        with tempfile.TemporaryDirectory() as runs_dir:
            chain = Chain(runs_dir, args.work, args.extra)
            chain.tune(1.0)
            slow_codes, slow_reports, back_codes, back_reports = [], [], [], []
            for i in range(args.trials):
                code, line, report = chain.retune(args.slower)
                slow_codes.append(code)
                slow_reports.append(report)
                print(f"slower {i + 1}: exit {code}: {line}", flush=True)
                code, line, report = chain.retune(1.0)
                back_codes.append(code)
                back_reports.append(report)
                print(f"back {i + 1}: exit {code}: {line}", flush=True)
            lines.append(summary(f"{args.slower}x slower, detections", slow_codes, slow_reports))
            lines.append(
                summary(f"back to 1x after {args.slower}x, false alarms", back_codes, back_reports)
            )
            lines.append(f"  a re-tune took {statistics.median(chain.seconds):.0f} s (median)")
    for line in lines:
        print(line, flush=True)
    print(f"total {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
