"""Many workers on one study, as separate machines run them: a PostgreSQL-backed Optuna study and
an MLflow tracking server (PostgreSQL backend, artifacts served by it), both real and on loopback.

Each worker is the real command in a process of its own, with its own working folder and
``runs_dir``; where ``unshare`` can give it a pid namespace of its own (as root), it is another
machine to the others, so a stopped worker is found by its heartbeat alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from invoke import measured, seed_peak, seed_runs_dir  # tests/ is on sys.path
from mlflow.tracking import MlflowClient
from servers import MlflowServer, Postgres, postgres_bin

from search.storage.liveness import DB_CONNECTIONS

REPO = Path(__file__).resolve().parents[2]
SPACE_DIR = REPO / "tests" / "cluster_space"
pytestmark = pytest.mark.slow

FAST = [
    "+space=load",
    "device=cpu",
    "measure.warmup_steps=1",
    "measure.warmup_s=0.05",
    "measure.window_s=0.03",
    "measure.min_windows=3",
    "measure.max_time_s=0.4",
    "revalidate.processes=0",
    "retune.confirm=0",
    "noise.budget=0",
    "study.sampler=random",
    "study.heartbeat_s=1",
]


def _own_namespace() -> list[str]:
    """``unshare`` into a pid namespace of its own, where it works here (root); else nothing."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    return (
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        if not probe.returncode
        else []
    )


NAMESPACE = _own_namespace()


@pytest.fixture(scope="module")
def pg():
    found = postgres_bin()
    if found is None:
        pytest.skip("PostgreSQL's server programs are not installed (.ci/run installs postgresql)")
    server = Postgres(found)
    yield server
    server.stop()


@pytest.fixture
def stores(pg, tmp_path, request):
    """A fresh Optuna database and an MLflow server on a fresh database of its own (for a test
    that kills its server)."""
    name = request.node.name[:40].lower()
    optuna_url = pg.create(f"optuna_{name}")
    mlflow_url = pg.create(f"mlflow_{name}")
    server = MlflowServer(mlflow_url, tmp_path / "artifacts", tmp_path / "mlflow.log").start()
    yield optuna_url, server, (f"optuna_{name}", f"mlflow_{name}")
    server.kill()
    pg.drop(f"optuna_{name}")
    pg.drop(f"mlflow_{name}")


@pytest.fixture(scope="module")
def shared_server(pg, tmp_path_factory):
    """One MLflow server for the tests of this module that leave it running: a server takes about
    11 s to start on two cores. Each test logs to an experiment of its own."""
    where = tmp_path_factory.mktemp("mlflow")
    server = MlflowServer(pg.create("mlflow_shared"), where / "artifacts", where / "mlflow.log")
    yield server.start()
    server.kill()
    pg.drop("mlflow_shared")


@pytest.fixture
def study_stores(pg, shared_server, request):
    """A fresh Optuna database, the shared MLflow server and an experiment named for the test."""
    name = request.node.name[:40].lower()
    optuna_url = pg.create(f"optuna_{name}")
    yield optuna_url, shared_server, (f"optuna_{name}", "mlflow_shared"), name
    pg.drop(f"optuna_{name}")


def worker(
    where: Path,
    storage: str,
    tracking: str,
    *overrides: str,
    command: str | None = None,
    namespace: bool = True,
) -> subprocess.Popen:
    """The same command a machine of a cluster runs, in a folder of its own."""
    where.mkdir(parents=True, exist_ok=True)
    seed_peak(where / "runs")  # the peak measured once, not by every worker (tests/invoke.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SPACE_DIR), str(REPO)])}
    return subprocess.Popen(
        [
            *(NAMESPACE if namespace else []),
            sys.executable,
            "-m",
            "search",
            *([command] if command else []),
            *FAST,
            "--config-dir",
            str(SPACE_DIR),
            f"study.storage={storage}",
            f"tracking.uri={tracking}",
            f"runs_dir={where / 'runs'}",
            *overrides,
        ],
        cwd=where,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def child_runs(uri: str, experiment: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    return [r for r in runs if "trial" in r.data.tags]


def config_key(trial: optuna.trial.FrozenTrial) -> str:
    return json.dumps(trial.user_attrs["config"], sort_keys=True)


class Peak:
    """The most connections each database had, read every 0.2 s while the workers run."""

    def __init__(self, pg: Postgres, databases: tuple[str, ...]) -> None:
        self.pg, self.databases = pg, databases
        self.peak = dict.fromkeys(databases, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for db in self.databases:
                self.peak[db] = max(self.peak[db], self.pg.connections(db))

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_workers_share_a_postgres_study_and_an_mlflow_server(pg, study_stores, tmp_path):
    storage, server, databases, experiment = study_stores
    peak = Peak(pg, databases)
    n_workers, each = 3, 5
    procs = [
        worker(
            tmp_path / f"machine{i}",
            storage,
            server.uri,
            f"study.n_trials={each}",
            f"tracking.experiment={experiment}",
        )
        for i in range(n_workers)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    connections = peak.stop()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out

    study = optuna.load_study(study_name="load-cpu", storage=storage)
    states = Counter(t.state for t in study.trials)
    assert states[optuna.trial.TrialState.RUNNING] == 0
    done = measured(study)
    assert len(done) == n_workers * each, "each worker measured its trials, none was lost"
    assert len({config_key(t) for t in done}) == len(done), "no configuration measured twice"
    assert len({json.dumps(t.user_attrs["owner"], sort_keys=True) for t in done}) == n_workers

    runs = child_runs(server.uri, experiment)
    by_trial = Counter(int(r.data.tags["trial"]) for r in runs)
    assert sorted(by_trial) == sorted(t.number for t in done), "every trial in MLflow"
    assert set(by_trial.values()) == {1}, "and exactly once"
    assert all(r.info.status == "FINISHED" for r in runs)
    assert {r.data.tags["study_id"] for r in runs} == {study.user_attrs["study_id"]}
    assert all(t.user_attrs["measured_on"].endswith(" cpu") for t in done), "which device"
    assert all(r.data.tags["measured_on"].endswith(" cpu") for r in runs)

    # One front: the tool's pareto tags are Optuna's best_trials, which the dashboard shows. Workers
    # finishing together tag what each saw; sync (as the summary run) tags everything stored.
    sync = worker(
        tmp_path / "machine0",
        storage,
        server.uri,
        f"tracking.experiment={experiment}",
        command="sync",
        namespace=False,
    )
    out = sync.communicate(timeout=300)[0]
    assert sync.returncode == 0, out
    runs = child_runs(server.uri, experiment)
    tagged = {int(r.data.tags["trial"]) for r in runs if r.data.tags.get("pareto") == "true"}
    best = {config_key(t) for t in study.best_trials}
    assert tagged and {config_key(study.trials[n]) for n in tagged} == best

    # Connections stay bounded: Optuna's pool per worker, MLflow's through its server's pool.
    optuna_db, mlflow_db = databases
    print(f"peak connections: {connections}")
    assert connections[optuna_db] <= DB_CONNECTIONS * n_workers, connections
    assert connections[mlflow_db] <= 20, connections


def test_a_killed_worker_s_trial_is_measured_again_by_another_after_the_grace_period(
    pg, study_stores, tmp_path
):
    if not NAMESPACE:
        pytest.skip("needs a pid namespace of its own for the killed worker (unshare, as root)")
    storage, server, _, experiment = study_stores
    slow = [
        "space.workload.step_ms=50",
        "measure.max_time_s=3",
        "measure.target_rel_ci=1e-9",
        f"tracking.experiment={experiment}",
    ]
    victim = worker(tmp_path / "victim", storage, server.uri, "study.n_trials=20", *slow)
    for line in victim.stdout:
        if line.startswith("[1/20]"):
            break
    study = optuna.load_study(study_name="load-cpu", storage=storage)
    deadline = time.monotonic() + 60
    while not study.get_trials(states=(optuna.trial.TrialState.RUNNING,)):  # its second trial
        assert time.monotonic() < deadline, "the victim started no second trial"
        time.sleep(0.1)
    time.sleep(0.5)  # its owner and first heartbeat written
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    left = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    assert len(left) == 1, "the kill left its trial RUNNING"
    before = {t.number: t.user_attrs["metrics"] for t in measured(study)}
    time.sleep(8)  # past the grace period (6 x 1 s), so the other worker finds it stale at once

    # Another machine: the victim's pid means nothing there, only its silence does (6 x 1 s).
    other = worker(
        tmp_path / "other",
        storage,
        server.uri,
        "study.n_trials=2",
        f"tracking.experiment={experiment}",
    )
    out = other.communicate(timeout=600)[0]
    assert other.returncode == 0, out
    assert f"recovered: trial #{left[0].number}" in out, out
    study = optuna.load_study(study_name="load-cpu", storage=storage)
    failed = study.trials[left[0].number]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert failed.user_attrs["failure"].startswith("crash: left running")
    retried = [t for t in measured(study) if t.user_attrs.get("retry_of") == left[0].number]
    assert len(retried) == 1 and retried[0].params == left[0].params
    after = {t.number: t.user_attrs["metrics"] for t in measured(study)}
    assert all(after[n] == m for n, m in before.items()), "no completed trial lost or changed"


def test_the_mlflow_server_killed_mid_study_loses_nothing_and_sync_repairs_it(pg, stores, tmp_path):
    storage, server, _ = stores
    procs = [
        worker(tmp_path / f"machine{i}", storage, server.uri, "study.n_trials=6") for i in range(2)
    ]
    seen = 0
    for line in procs[0].stdout:
        seen += line.startswith("[")
        if seen >= 2:
            break
    server.kill()
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    assert any("python -m search sync" in out for out in outs)
    study = optuna.load_study(study_name="load-cpu", storage=storage)
    done = measured(study)
    assert len(done) == 12 and len({config_key(t) for t in done}) == 12, "nothing lost"

    server.start()  # the same database, the same port
    sync = worker(tmp_path / "machine0", storage, server.uri, command="sync", namespace=False)
    out = sync.communicate(timeout=600)[0]
    assert sync.returncode == 0, out
    runs = [r for r in child_runs(server.uri, "load") if r.info.status == "FINISHED"]
    by_trial = Counter(int(r.data.tags["trial"]) for r in runs)
    assert sorted(by_trial) == sorted(t.number for t in done) and set(by_trial.values()) == {1}


CLUSTER = REPO / "examples" / "cluster"


def test_the_launch_recipes_parse():
    for script in ("one_node.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(CLUSTER / script)], check=True)
    sbatch = (CLUSTER / "slurm.sbatch").read_text()
    assert "#SBATCH --gpus-per-task=1" in sbatch and "study.n_trials=0" in sbatch
    import yaml

    workers, summary = yaml.safe_load_all((CLUSTER / "k8s-indexed-job.yaml").read_text())
    spec = workers["spec"]
    assert workers["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    (container,) = spec["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "revalidate.processes=0" in container["args"]
    (last,) = summary["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert "study.n_trials=0" in last["args"]


def test_one_worker_per_gpu_then_one_summary_on_a_cpu_stand_in(tmp_path):
    # The recipe as it runs on a GPU machine, with two CPU "GPUs": the workers search, the last
    # command re-validates and summarises every worker's trials.
    env = {
        **os.environ,
        "GPUS": "0\n1",  # as nvidia-smi lists them: one a line
        "PYTHONPATH": os.pathsep.join([str(SPACE_DIR), str(REPO)]),
    }
    args = [
        *FAST,
        "--config-dir",
        str(SPACE_DIR),
        "study.n_trials=1",
        "revalidate.max_candidates=1",
        f"runs_dir={tmp_path / 'runs'}",
    ]
    args[args.index("revalidate.processes=0")] = "revalidate.processes=2"
    seed_runs_dir(tmp_path / "runs")
    result = subprocess.run(
        ["bash", str(CLUSTER / "one_node.sh"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    logs = sorted(p.name for p in tmp_path.glob("worker-gpu*.log"))
    assert logs == ["worker-gpu0.log", "worker-gpu1.log"]
    for log in logs:
        assert "re-validating" not in (tmp_path / log).read_text()
    assert "this run: 0 measured" in result.stdout and "Study total: 2 measured" in result.stdout
    assert "re-validating 1 Pareto candidate(s)" in result.stdout
    study = optuna.load_study(study_name="load-cpu", storage=f"sqlite:///{tmp_path}/runs/optuna.db")
    assert len({json.dumps(t.user_attrs["owner"], sort_keys=True) for t in measured(study)}) == 2


def _recipe_args(tmp_path: Path) -> list[str]:
    # The summary re-validates (asserted below) but confirms nothing: its 4 confirmation runs, each
    # after a run of the reference step, were a third of the recipe's time (20 of 58 s with Ray).
    # The MLflow store is seeded empty, as for the other tests: the two workers would otherwise each
    # build its schema at once (about 3 s of migrations each), one of them waiting out the other.
    seed_runs_dir(tmp_path / "runs")
    return [
        *[a for a in FAST if a != "revalidate.processes=0"],
        "--config-dir",
        str(SPACE_DIR),
        "study.n_trials=1",  # a trial a worker: two workers, two owners
        "revalidate.max_candidates=1",
        f"runs_dir={tmp_path / 'runs'}",
    ]


def _two_workers_and_a_summary(tmp_path: Path, out: str) -> None:
    assert "worker 0 on" in out and "worker 1 on" in out and "summary on" in out
    assert "re-validating 1 Pareto candidate(s)" in out and "Study total: 2 measured" in out
    study = optuna.load_study(study_name="load-cpu", storage=f"sqlite:///{tmp_path}/runs/optuna.db")
    assert len({json.dumps(t.user_attrs["owner"], sort_keys=True) for t in measured(study)}) == 2


def test_the_submitit_recipe_runs_a_task_per_gpu_then_the_summary_locally(tmp_path):
    # submitit's local executor: the same code as on SLURM, tasks as processes of this machine.
    # It shows each task both "GPUs" (CPU stand-ins); each worker keeps the one of its rank.
    pytest.importorskip("submitit")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SPACE_DIR), str(REPO)])}
    recipe = [sys.executable, str(CLUSTER / "submitit_launch.py"), "--cluster", "local"]
    result = subprocess.run(
        [*recipe, "--gpus-per-node", "2", "--cpus-per-task", "1", "--", *_recipe_args(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker task 0: exit 0" in result.stdout and "worker task 1: exit 0" in result.stdout
    logs = {p.name: p.read_text() for p in (tmp_path / "submitit").glob("*_log.out")}
    workers = "".join(text for text in logs.values() if "summary on" not in text)
    assert "CUDA_VISIBLE_DEVICES=0" in workers and "CUDA_VISIBLE_DEVICES=1" in workers
    for text in logs.values():
        assert "re-validating" not in text or "summary on" in text
    _two_workers_and_a_summary(tmp_path, workers + result.stdout)


def test_the_ray_recipe_runs_a_task_per_gpu_then_the_summary(tmp_path):
    # A Ray cluster of one node started as a cluster is (ray start --head), declaring two GPUs
    # (CPU stand-ins): Ray gives each num_gpus=1 task one of them through CUDA_VISIBLE_DEVICES.
    pytest.importorskip("ray")
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SPACE_DIR), str(REPO)]),
        # Tasks at normal priority, as the recipe asks: at Ray's default niceness of 15 the tasks
        # waited for the CPU behind the suite's other tests (222 s against 47 s alone).
        "RAY_worker_niceness": "0",
    }
    port = _free_port()
    head = ["start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=2"]
    started = subprocess.run(
        [*ray, *head, "--include-dashboard=false"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(CLUSTER / "ray_launch.py"),
                f"--address=127.0.0.1:{port}",
                "--cpus-per-worker=1",
                "--",
                *_recipe_args(tmp_path),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        subprocess.run([*ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "worker task 0: exit 0" in out and "worker task 1: exit 0" in out
    assert "CUDA_VISIBLE_DEVICES=0" in out and "CUDA_VISIBLE_DEVICES=1" in out
    assert "niceness" not in out, out
    _two_workers_and_a_summary(tmp_path, out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
