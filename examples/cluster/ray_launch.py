"""One worker per GPU of a Ray cluster, all on one study, then one summary.

    RAY_worker_niceness=0 ray start --head --num-gpus=8   # or an existing cluster (RAY_ADDRESS)
    python examples/cluster/ray_launch.py -- +space=llm study.n_trials=6 \\
        study.storage=postgresql://user@db/tuning tracking.uri=http://mlflow:5000

Each worker is a Ray task with `num_gpus=1` running the ordinary command; Ray gives it one GPU
and sets its CUDA_VISIBLE_DEVICES, so it sees that GPU as `cuda:0`. After every worker, one more
task (one GPU) runs the summary: re-validation and confirmation over every worker's trials. A task
whose node is lost is retried by Ray (a new worker on the same study; the lost trial is measured
again after the heartbeat grace period). The workers' output comes to this terminal, prefixed by
Ray with the task's process.

Assumes: the project in the Python of every node, a PostgreSQL study and an MLflow server that
every node reaches (sqlite and a local folder do on one machine). Ray sets OMP_NUM_THREADS to a
task's CPUs: give the workers the CPUs a trial should use (--cpus-per-worker). Ray runs its
tasks at niceness 15 unless the node was started with RAY_worker_niceness=0, and the trials'
processes inherit it: they then yield the CPU to every other process of the node, so their timings
say more about the node's load than about the configuration. Each task says so where it happens.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

from search import launch


@ray.remote
def _run(overrides: list[str], summary: bool, name: str) -> int:
    niceness = os.nice(0)
    if niceness > 0:  # an unprivileged process cannot lower it again
        print(
            f"note: {name} runs at niceness {niceness} (Ray's default for tasks): its trials yield "
            "the CPU to every other process of the node; start the nodes with "
            "RAY_worker_niceness=0 ray start ..."
        )
    return launch.run(overrides, summary=summary, name=name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--address",
        default="auto",
        help="the Ray cluster (default: the one running here or RAY_ADDRESS)",
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="default: one per GPU of the cluster"
    )
    parser.add_argument("--cpus-per-worker", type=float, default=8)
    parser.add_argument("overrides", nargs="*", help="the command's overrides (after --)")
    args = parser.parse_args()

    ray.init(address=args.address)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus < 1:
        print(
            "error: the Ray cluster has no GPU; start its nodes with GPUs (ray start --num-gpus=N)"
        )
        return 2
    workers = args.workers or gpus
    if workers > gpus:
        print(f"note: {workers} workers on {gpus} GPU(s): the others wait for a GPU to free up")
    options = {"num_gpus": 1, "num_cpus": args.cpus_per_worker}
    refs = [
        _run.options(**options).remote(args.overrides, False, f"worker {i}") for i in range(workers)
    ]
    print(f"workers: {workers} Ray task(s), one GPU each", flush=True)
    failed = 0
    for i, ref in enumerate(refs):
        try:
            rc = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the task raised, or Ray gave up on it
            rc, why = 1, str(exc).splitlines()[0]
            print(f"worker task {i}: {why}")
        print(f"worker task {i}: exit {rc}")
        failed += rc != 0
    if failed:
        print(f"{failed} worker(s) failed; the summary covers what was stored")
    return ray.get(_run.options(**options).remote(args.overrides, True, "summary"))


if __name__ == "__main__":
    sys.exit(main())
