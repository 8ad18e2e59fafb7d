"""Many workers on one PostgreSQL-backed study with an MLflow server, against one worker.

Starts a private PostgreSQL server and an MLflow tracking server on it (both on loopback, removed
at the end), then runs the real command on a fast synthetic workload (``tests/cluster_space``):
first one worker alone, then ``--workers`` workers at once, each with its own folder (as separate
machines would). Checks what the issue asks of a shared study: no trial lost, no configuration
measured twice, every measured trial in MLflow exactly once, the ``pareto`` tags equal to Optuna's
``best_trials``; and reports trials per minute and the most connections each database had.

    python benchmarks/many_workers.py --workers 4 --trials 50

PostgreSQL's server programs must be installed (Debian: ``apt-get install postgresql``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import optuna

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from servers import MlflowServer, Postgres, postgres_bin  # noqa: E402
from test_cluster import Peak, child_runs, config_key, measured, worker  # noqa: E402


def session(pg: Postgres, root: Path, name: str, n_workers: int, trials: int) -> dict:
    storage = pg.create(f"optuna_{name}")
    server = MlflowServer(pg.create(f"mlflow_{name}"), root / name / "art", root / f"{name}.log")
    server.start()
    peak = Peak(pg, (f"optuna_{name}", f"mlflow_{name}"))
    started = time.monotonic()
    procs = [
        worker(root / name / f"machine{i}", storage, server.uri, f"study.n_trials={trials}")
        for i in range(n_workers)
    ]
    codes = []
    for p in procs:
        out = p.communicate(timeout=7200)[0]
        codes.append(p.returncode)
        if p.returncode:
            print(out[-3000:])
    wall_s = time.monotonic() - started
    connections = peak.stop()
    study = optuna.load_study(study_name="load-cpu", storage=storage)
    done = measured(study)
    runs = child_runs(server.uri, "load")
    per_trial = Counter(int(r.data.tags["trial"]) for r in runs)
    tagged = {int(r.data.tags["trial"]) for r in runs if r.data.tags.get("pareto") == "true"}
    server.kill()
    return {
        "workers": n_workers,
        "exit codes": codes,
        "measured": len(done),
        "asked for": n_workers * trials,
        "configurations measured twice": len(done) - len({config_key(t) for t in done}),
        "left running": sum(t.state == optuna.trial.TrialState.RUNNING for t in study.trials),
        "trials without an MLflow run": len({t.number for t in done} - set(per_trial)),
        "trials with more than one run": sum(n > 1 for n in per_trial.values()),
        "pareto tags == best_trials": {config_key(study.trials[n]) for n in tagged}
        == {config_key(t) for t in study.best_trials},
        "wall s": round(wall_s, 1),
        "trials per minute": round(len(done) / wall_s * 60, 2),
        "peak connections (optuna, mlflow)": tuple(connections.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=50, help="trials per worker")
    args = parser.parse_args()
    found = postgres_bin()
    if found is None:
        print("PostgreSQL's server programs are not installed (apt-get install postgresql)")
        return 2
    pg = Postgres(found)
    try:
        with tempfile.TemporaryDirectory(prefix="many-workers-") as tmp:
            for name, n in (("one", 1), ("many", args.workers)):
                print(json.dumps(session(pg, Path(tmp), name, n, args.trials)), flush=True)
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
