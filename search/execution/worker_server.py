"""The fork server that trial workers are forked from: how workers start (``worker_context``),
and the server started early (``start_worker_server``).

Light on purpose: it imports nothing of torch, so the command line starts the server before its own
imports, which the server's then overlap (``search.commands.cli``).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from collections.abc import Sequence
from typing import Any

__all__ = ["WORKER_IMPORTS", "serve_workers_with", "start_worker_server", "worker_context"]

WORKER_IMPORTS = "SEARCH_WORKER_IMPORTS"
"""The environment variable that names, comma-separated, the modules the fork server imports
beyond its own (``serve_workers_with``), each where it can (``search.execution._fork_server``)."""


@functools.cache
def worker_context() -> (
    multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
):
    """How trial workers start: forked from a fork server that has imported the trial's modules
    (``search.execution._fork_server``: torch and its compiler) once, so a fresh worker costs
    milliseconds, not the 2-3 s of importing torch again. The server itself is started from a
    clean ``exec`` and runs no torch code (no threads, no CUDA), so nothing of the study's own
    state reaches a worker, as with ``spawn``; ``spawn`` is used where there is no fork server
    (not on POSIX)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # read when the server starts (the first worker)
    context.set_forkserver_preload(["search.execution._fork_server"])
    return context


def start_worker_server() -> None:
    """Start the fork server now, without waiting for it. Its imports (torch and its compiler:
    about 3.5 s of a core on a 2-core CPU) then overlap the study process's own start (its
    imports, the stores, the parent run) instead of delaying the workload's checks and the first
    trial (``docs/operations/failures.md``). Nothing where workers are spawned."""
    if worker_context().get_start_method() == "forkserver":
        multiprocessing.forkserver.ensure_running()


_served: list[str] = []
"""The modules the running server was started with beyond its own (``serve_workers_with``)."""


def serve_workers_with(modules: Sequence[str]) -> None:
    """Have the workers forked from now on start with ``modules`` imported too (a workload's
    library, ``Workload.preload``): the fork server imports them once, instead of every trial's
    process (its first and second, re-validation's, confirmation's) importing them anew. A
    server that has not imported them yet is stopped and started again with them; call it before
    the first worker is needed. Nothing where workers are spawned, or where the server has them.
    The modules reach the server through ``WORKER_IMPORTS`` as it starts, and no other process:
    a command this process runs later starts its own server with its own workload's."""
    if not modules or worker_context().get_start_method() != "forkserver":
        return
    wanted = list(dict.fromkeys([*_served, *modules]))
    # The module's own server, as ensure_running starts it: its pid and its stop are private.
    server: Any = multiprocessing.forkserver._forkserver
    if wanted == _served and server._forkserver_pid is not None:
        return
    if server._forkserver_pid is not None:
        # Killed, not asked: a server asked to stop finishes its imports first (3.5 s).
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server._stop()
    before = os.environ.get(WORKER_IMPORTS)
    os.environ[WORKER_IMPORTS] = ",".join(wanted)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[WORKER_IMPORTS]
        else:
            os.environ[WORKER_IMPORTS] = before
    _served[:] = wanted
