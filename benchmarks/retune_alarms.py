"""False alarms and detection of ``python -m search retune``, on this machine.

For each slowdown factor: one tuning of a synthetic workload at factor 1 (the baseline), then
``--retunes`` re-tunes of the same workload made ``factor`` times slower, each compared with that
tuning (``retune.baseline=<its name>``), and the share that exit 3 (a regression). Factor 1 counts
false alarms; factor 1.1 (10% slower) detections.

The workload (``tests/retune_space/slowdown.py``, ``work: matmul``) does real compute, so the
machine's own noise is in every figure. Run it on an otherwise idle machine:

    python benchmarks/retune_alarms.py --retunes 20 --factors 1.0 1.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from search.retune import tuned_runs  # noqa: E402

SETTINGS = [
    "--config-dir",
    str(REPO / "tests" / "retune_space"),
    "+space=slowdown",
    "device=cpu",
    "+space.workload.work=matmul",
    "+space.workload.base=200",
    "measure.warmup_s=0.2",
    "measure.window_s=0.1",
    "measure.min_windows=5",
    "measure.max_time_s=2",
    "study.n_trials=4",
    "study.sampler=random",
]


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
        timeout=1200,
    )


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    low = stats.beta.ppf(0.025, k, n - k + 1) if k else 0.0
    high = stats.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    return float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retunes", type=int, default=20)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.1])
    args = parser.parse_args()
    started = time.monotonic()
    for factor in args.factors:
        with tempfile.TemporaryDirectory() as runs_dir:
            common = [*SETTINGS, f"runs_dir={runs_dir}"]
            tune = search(*common)
            if tune.returncode != 0:
                sys.exit(f"the tuning failed:\n{tune.stdout}\n{tune.stderr}")
            study = optuna.load_study(
                study_name="slowdown-cpu", storage=f"sqlite:///{runs_dir}/optuna.db"
            )
            name = tuned_runs(study)[-1].name
            codes, ratios, seconds = [], [], []
            for i in range(args.retunes):
                t0 = time.monotonic()
                result = search(
                    "retune",
                    *common,
                    f"space.workload.factor={factor}",
                    f"retune.baseline={name}",
                )
                seconds.append(time.monotonic() - t0)
                codes.append(result.returncode)
                reports = sorted((Path(runs_dir) / "slowdown-cpu" / "retune").glob("*.json"))
                best = next(
                    (
                        c
                        for c in json.loads(reports[-1].read_text())["comparisons"]
                        if c["what"].startswith("best")
                    ),
                    None,
                )
                ratios.append(best["ratio"] if best else float("nan"))
                line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
                print(
                    f"factor {factor}: retune {i + 1}: exit {result.returncode}: {line}", flush=True
                )
                if result.returncode not in (0, 3):
                    print(result.stderr[-2000:], flush=True)
            alarms = codes.count(3)
            low, high = clopper_pearson(alarms, len(codes))
            print(
                f"factor {factor}: exit 3 in {alarms}/{len(codes)} re-tunes "
                f"({alarms / len(codes):.0%}, 95% CI [{low:.0%}, {high:.0%}]); best ratio median "
                f"{sorted(ratios)[len(ratios) // 2]:.3f}, range {min(ratios):.3f}-"
                f"{max(ratios):.3f}; a re-tune took {sorted(seconds)[len(seconds) // 2]:.0f} s "
                "(median)",
                flush=True,
            )
    print(f"total {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
