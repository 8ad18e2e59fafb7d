"""What a tiny study writes, with every number masked, so that two versions can be compared.

    python benchmarks/behaviour_snapshot.py --repo OLD_CHECKOUT --out before1.json   # a few times
    python benchmarks/behaviour_snapshot.py --repo . --out after1.json               # as many
    python benchmarks/behaviour_snapshot.py --compare before*.json -- after*.json

Runs one tiny study (random sampler, fixed seed, racing off, lenient stability, so the sampled
configurations do not depend on the timings) with ``python -m search`` from ``--repo``, then writes
what it left, numbers and identifiers replaced by ``#``:

- the output lines (stdout and stderr);
- the files under the runs directory;
- each MLflow run's params (keys and values), metric keys and tags (keys and values);
- the Optuna study's attributes and each trial's state, params and attribute keys.

A refactoring that changes none of these leaves the two files identical, up to what the measured
figures decide: which configurations make the front, whether the drift is significant. Those can
differ between two runs of one version, so ``--compare`` reads several runs of each version and
reports what one version ever wrote that the other never did; for a refactoring, nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TINY_STUDY = [
    "+space=llm",
    "device=cpu",
    "preset=cpu",
    "study.n_trials=4",
    "study.sampler=random",
    "seed=3",
    "space.workload.vocab_size=256",
    "space.workload.seq_len=32",
    "space.workload.d_model=32",
    "space.workload.n_layers=1",
    "space.workload.n_heads=2",
    "space.params.batch_size.high=8",
    "space.params.micro_batch_size.high=8",
    "measure.warmup_s=0.1",
    "measure.window_s=0.05",
    "measure.min_windows=3",
    "measure.max_windows=3",
    "measure.target_rel_ci=1e-6",  # every measurement stops at max_windows, whatever its noise
    "measure.max_time_s=1",
    "measure.race=false",
    "noise.start_runs=2",
    "revalidate.processes=2",
    "retune.confirm=4",
    "stable.excess_cv=10",
    "stable.excess_stalls=1",
    "stable.excess_between_cv=10",
]
"""Everything that could make the sampled configurations depend on the machine's speed is fixed."""

_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d[\d,]*(\.\d+)?([eE][-+]?\d+)?[kMGT%x]?")
_HEX_ID = re.compile(r"\b[0-9a-f]{12,}\b")
_REPEATS = re.compile(r"([ ━─])\1+")


def masked(text: str, runs_dir: Path) -> str:
    """``text`` with the runs directory, identifiers and numbers replaced."""
    text = text.replace(str(runs_dir), "<runs>")
    text = _HEX_ID.sub("<id>", text)
    text = _NUMBER.sub("#", text)
    # a table's column widths follow the widths of its numbers
    return _REPEATS.sub(r"\1", text)


def mlflow_runs(runs_dir: Path) -> list[dict[str, Any]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir}/mlflow.db")
    runs = []
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], max_results=10_000):
            data = run.data
            runs.append(
                {
                    "params": {k: masked(v, runs_dir) for k, v in sorted(data.params.items())},
                    "metrics": sorted(data.metrics),
                    "tags": {k: masked(v, runs_dir) for k, v in sorted(data.tags.items())},
                }
            )
    return sorted(runs, key=lambda run: json.dumps(run, sort_keys=True))


def keys(attrs: dict[str, Any], runs_dir: Path) -> list[str]:
    """Attribute names, masked: some hold a time or a process's name."""
    return sorted(masked(name, runs_dir) for name in attrs)


def optuna_study(runs_dir: Path) -> dict[str, Any]:
    import optuna

    storage = f"sqlite:///{runs_dir}/optuna.db"
    studies = {}
    for summary in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        studies[summary.study_name] = {
            "user_attrs": keys(study.user_attrs, runs_dir),
            "system_attrs": keys(study._storage.get_study_system_attrs(study._study_id), runs_dir),
            "trials": [
                {
                    "state": trial.state.name,
                    "params": {k: str(v) for k, v in sorted(trial.params.items())},
                    "user_attrs": keys(trial.user_attrs, runs_dir),
                    "system_attrs": keys(trial.system_attrs, runs_dir),
                }
                for trial in study.trials
            ],
        }
    return studies


def snapshot(repo: Path, runs_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "search", *TINY_STUDY, f"runs_dir={runs_dir}"]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    files = sorted(str(p.relative_to(runs_dir)) for p in runs_dir.rglob("*") if p.is_file())
    return {
        "exit_code": done.returncode,
        "stdout": [masked(line, runs_dir) for line in done.stdout.splitlines()],
        "stderr": [masked(line, runs_dir) for line in done.stderr.splitlines()],
        "files": sorted({masked(name, runs_dir) for name in files}),
        "mlflow_runs": mlflow_runs(runs_dir),
        "optuna": optuna_study(runs_dir),
    }


def facts(snapshot: dict[str, Any]) -> set[str]:
    """Every line, file, MLflow key and value, and Optuna attribute of one snapshot, as strings."""
    found = {f"exit {snapshot['exit_code']}"}
    found |= {f"stdout: {line}" for line in snapshot["stdout"]}
    found |= {f"stderr: {line}" for line in snapshot["stderr"]}
    found |= {f"file: {name}" for name in snapshot["files"]}
    for run in snapshot["mlflow_runs"]:
        found |= {f"mlflow param: {k}={v}" for k, v in run["params"].items()}
        found |= {f"mlflow metric: {k}" for k in run["metrics"]}
        found |= {f"mlflow tag: {k}={v}" for k, v in run["tags"].items()}
    for name, study in snapshot["optuna"].items():
        found |= {f"optuna study {name} attr: {k}" for k in study["user_attrs"]}
        found |= {f"optuna study {name} system attr: {k}" for k in study["system_attrs"]}
        for trial in study["trials"]:
            found.add(f"optuna trial state: {trial['state']}")
            found |= {f"optuna trial attr: {k}" for k in trial["user_attrs"]}
            found |= {f"optuna trial system attr: {k}" for k in trial["system_attrs"]}
            found |= {f"optuna trial param: {k}={v}" for k, v in trial["params"].items()}
    return found


def compare(before: list[Path], after: list[Path]) -> int:
    """Print what one version ever wrote that the other never did; 0 when nothing."""
    seen = [set().union(*(facts(json.loads(p.read_text())) for p in ps)) for ps in (before, after)]
    only_before, only_after = sorted(seen[0] - seen[1]), sorted(seen[1] - seen[0])
    print(
        f"{len(seen[0])} facts in {len(before)} run(s) before, {len(seen[1])} in {len(after)} after"
    )
    for label, only in (("only before", only_before), ("only after", only_after)):
        print(f"{label}: {len(only)}")
        print("\n".join(f"  {fact[:200]}" for fact in only))
    return 1 if only_before or only_after else 0


def main() -> None:
    if "--compare" in sys.argv:
        rest = sys.argv[sys.argv.index("--compare") + 1 :]
        split = rest.index("--")
        sys.exit(compare([Path(p) for p in rest[:split]], [Path(p) for p in rest[split + 1 :]]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path("."), help="the version to run")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        result = snapshot(args.repo.resolve(), Path(scratch) / "runs")
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"exit {result['exit_code']}; {len(result['stdout'])} output lines; wrote {args.out}")


if __name__ == "__main__":
    main()
