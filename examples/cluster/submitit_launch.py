"""One worker per GPU with submitit (SLURM, or this machine), all on one study, then one summary.

    python examples/cluster/submitit_launch.py --nodes 2 --gpus-per-node 8 --partition gpu -- \\
        +space=llm study.n_trials=6 study.storage=postgresql://user@db/tuning \\
        tracking.uri=http://mlflow:5000

submitit (the library under Hydra's submitit launcher) submits one SLURM job of nodes x GPUs tasks,
one GPU each, waits for it, then a one-task job for the summary (re-validation and confirmation
on one GPU, over every worker's trials). Without SLURM (`--cluster local`, the default where
`srun` is absent) the same code runs the tasks as processes of this machine, each pinned to one
GPU. Logs: `submitit/` (one `<job>_<task>_log.out` per task). Hydra's launcher plugins launch
`@hydra.main` sweeps; this tool composes its configuration itself, so the recipe calls submitit.

Assumes: `pip install submitit` and the project in the job's Python on every node; a PostgreSQL
study and an MLflow server that every node reaches (sqlite and a local folder do on one machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import submitit

from search import launch


def _worker(overrides: list[str]) -> int:
    job = submitit.JobEnvironment()
    return launch.run(overrides, rank=job.local_rank, name=f"worker {job.global_rank}")


def _summary(overrides: list[str]) -> int:
    return launch.run(overrides, summary=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cluster",
        choices=["slurm", "local"],
        default=None,
        help="default: slurm where srun is found, else local",
    )
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=1, help="one worker per GPU")
    parser.add_argument("--cpus-per-task", type=int, default=8)
    parser.add_argument("--partition", default=None, help="the SLURM partition")
    parser.add_argument("--timeout-min", type=int, default=240, help="per job")
    parser.add_argument("--folder", default="submitit", help="logs and job files")
    parser.add_argument("overrides", nargs="*", help="the command's overrides (after --)")
    args = parser.parse_args()

    executor = submitit.AutoExecutor(folder=Path(args.folder), cluster=args.cluster)
    common = {"timeout_min": args.timeout_min, "name": "search"}
    if args.partition:
        common["slurm_partition"] = args.partition
    executor.update_parameters(
        nodes=args.nodes,
        tasks_per_node=args.gpus_per_node,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        **common,
    )
    job = executor.submit(_worker, args.overrides)
    print(
        f"workers: job {job.job_id} ({executor.cluster}), "
        f"{args.nodes * args.gpus_per_node} task(s)",
        flush=True,
    )
    failed = 0
    for task in range(job.num_tasks):
        try:
            rc = job.task(task).result()
        except submitit.core.utils.UncompletedJobError as exc:  # raised, killed, timed out
            rc = 1
            print(f"worker task {task}: {str(exc).splitlines()[0]}")
        print(f"worker task {task}: exit {rc}")
        failed += rc != 0
    if failed:
        print(f"{failed} worker(s) failed: see {args.folder}/; the summary covers what was stored")

    executor.update_parameters(nodes=1, tasks_per_node=1, gpus_per_node=min(1, args.gpus_per_node))
    summary = executor.submit(_summary, args.overrides)
    print(f"summary: job {summary.job_id}", flush=True)
    try:
        rc = summary.result()
    except submitit.core.utils.UncompletedJobError as exc:
        print(f"summary: {str(exc).splitlines()[0]}")
        rc = 1
    print(summary.stdout() or "", end="")
    return rc


if __name__ == "__main__":
    sys.exit(main())
