"""The fork server that trial workers are forked from: how workers start (``worker_context``),
and the server started early (``start_worker_server``).

Light on purpose: it imports nothing of torch, so the command line starts the server before its own
imports, which the server's then overlap (``search.commands.cli``).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver

__all__ = ["start_worker_server", "worker_context"]


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
