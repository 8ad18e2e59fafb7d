"""Real servers for the many-worker tests: a private PostgreSQL cluster and an MLflow tracking
server with a PostgreSQL backend, both on loopback, started and removed by the tests.

PostgreSQL comes from the machine (Debian's ``postgresql`` package: ``.ci/run`` installs it);
where its programs are absent the tests that need it are skipped with that reason. As root the
server runs as the ``postgres`` user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import sqlalchemy as sa

USER = "search"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``), None if absent."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3])
    )
    return Path(versions[-1]).parent if versions else None


class Postgres:
    """A PostgreSQL cluster of its own in a temporary folder, trusting local connections."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="search-pg-"))
        self.port = free_port()
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.root, user="postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.root / "data"), "-A", "trust", "-U", USER, "-N")
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c max_connections=300 -c fsync=off -c synchronous_commit=off"
        )
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-w", "start",
                  "-l", str(self.root / "log"))  # fmt: skip
        self.admin = sa.create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [*self.as_user, str(self.bin / program), *args],
            check=True,
            capture_output=True,
            cwd=self.root,
        )

    def url(self, database: str) -> str:
        """As a user writes it: ``postgresql://`` (SQLAlchemy takes psycopg for it)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create(self, database: str) -> str:
        with self.admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
            c.execute(sa.text(f'CREATE DATABASE "{database}"'))
        return self.url(database)

    def drop(self, database: str) -> None:
        with self.admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))

    def connections(self, database: str) -> int:
        with self.admin.connect() as c:
            query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d")
            return int(c.execute(query, {"d": database}).scalar_one())

    def stop(self) -> None:
        self.admin.dispose()
        subprocess.run(
            [*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-m",
             "immediate", "stop"],
            capture_output=True,
            cwd=self.root,
        )  # fmt: skip
        shutil.rmtree(self.root, ignore_errors=True)


class MlflowServer:
    """``mlflow server`` on loopback with a database backend and artifacts it serves itself."""

    def __init__(self, backend_uri: str, artifacts: Path, log: Path) -> None:
        self.backend_uri, self.artifacts, self.log = backend_uri, artifacts, log
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> MlflowServer:
        """Start the server and wait for its health check. One worker: each worker is a process
        that imports MLflow's server again (6-11 s of CPU on two cores), and one serves the
        tests' few workers (requests wait in its thread pool, not for a process)."""
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                 self.backend_uri, "--artifacts-destination", str(self.artifacts), "--host",
                 "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not answer in {timeout_s:.0f} s")

    def kill(self) -> None:
        """``kill -9`` of the server and its workers."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
