"""The isolated worker: each trial in a fresh process of its own, its stderr kept, its process
group killed.

``run_isolated`` runs each trial in a fresh process: peak memory is then the trial's own (a reused
process keeps memory an earlier trial freed, and CPU figures read low or zero), global torch state
cannot leak between trials, and a worker that dies takes only its trial with it: a ``crash`` with
its signal or exit code and the tail of its stderr, or a ``timeout`` killed with every process it
started.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from search.core.records import FAILED
from search.execution.phases import count_timed
from search.execution.trial import TrialRequest, TrialResult
from search.execution.worker import run_trial
from search.execution.worker_server import worker_context

__all__ = [
    "STDERR_KEPT_BYTES",
    "STDERR_TAIL_LINES",
    "die_with_parent",
    "run_in_a_worker",
    "run_isolated",
    "wait_for_worker_server",
    "worker_context",
]

STDERR_TAIL_LINES = 20
"""How many lines of a worker's stderr a failed trial keeps (``TrialResult.stderr_tail``)."""
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def wait_for_worker_server() -> None:
    """Return once the fork server has imported what workers need (a worker that does nothing,
    started and joined): a measurement of the machine must not share the CPU with those imports.
    The peak measured beside them read 70 GFLOP/s where it reads 128 without."""
    context = worker_context()
    if context.get_start_method() == "forkserver":
        process = context.Process(target=os.getpid)
        process.start()
        process.join()


def run_isolated(request: TrialRequest) -> TrialResult:
    """``run_trial`` in a fresh process (``worker_context``), in a process group of its own.

    A worker that dies is a ``crash`` (with its signal or exit code and the tail of its stderr); one
    still running after ``request.timeout_s`` is a ``timeout``, killed with every process it
    started.
    """
    started = time.perf_counter()
    context = worker_context()
    receive, send = context.Pipe(duplex=False)
    # The worker's stderr goes into a pipe of which only the end is kept: nothing is left behind on
    # disk, even when the study is killed with kill -9, and a chatty workload cannot fill the disk
    # or the memory.
    stderr = _StderrTail()
    worker = context.Process(
        target=_worker, args=(request, send, _InheritedFd(stderr.write_fd)), daemon=True
    )
    reaped = False
    try:
        with _ctrl_c_after():
            worker.start()
        send.close()
        stderr.close_writer()  # the worker has its own copy: EOF comes when it (and its kin) end
        try:
            result = receive.recv() if receive.poll(request.timeout_s) else None
        except (EOFError, OSError, pickle.UnpicklingError):
            # The worker died before it answered, or while it did: a message cut halfway reads as
            # end of file, a reset connection or a broken pickle.
            _kill_group(worker)  # what it started dies with it; its exit status is already fixed
            worker.join()
            reaped = True
            return _crashed(worker, stderr, started)
        answered = _answered(result, request, worker, stderr, started)
        count_timed(answered.phases_s)
        return answered
    except BaseException:
        if worker.pid is not None:
            _kill_group(worker)
        raise
    finally:
        receive.close()
        send.close()
        if worker.pid is not None and not reaped:
            _reap(worker)  # leftovers of a finished trial (its own helper processes)
        stderr.close()


def run_in_a_worker(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in a fresh worker, as a trial runs, its output thrown away; None where it
    dies or runs past ``timeout_s`` (its process group then killed). For the checks that run a
    workload's own code before a study (``search.config.contract``): a workload that crashes,
    exits or hangs there must not take the study process with it."""
    context = worker_context()
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_answer_quietly, args=(send, fn, args), daemon=True)
    worker.start()
    send.close()
    try:
        return receive.recv() if receive.poll(timeout_s) else None
    except (EOFError, OSError, pickle.UnpicklingError):
        return None
    finally:
        receive.close()
        _kill_group(worker)
        worker.join()


def _answer_quietly(send, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    send.send(fn(*args))
    send.close()


def _crashed(worker, stderr: _StderrTail, started: float) -> TrialResult:
    """The ``crash`` of a worker that died before it answered, with the tail of its stderr."""
    tail = stderr.text()
    said = _headline(tail)
    return TrialResult(
        state=FAILED,
        failure=f"crash: worker {_exit_text(worker.exitcode)}"
        + (f"; stderr: {said}" if said else ""),
        stderr_tail=tail,
        duration_s=time.perf_counter() - started,
    )


def _answered(
    result: TrialResult | None,
    request: TrialRequest,
    worker,
    stderr: _StderrTail,
    started: float,
) -> TrialResult:
    """The trial's result from the worker's answer: a ``timeout`` when none came in time, a
    failure with the tail of the worker's stderr, anything else as it came."""
    if result is None:
        _kill_group(worker)
        return TrialResult(
            state=FAILED,
            duration_s=time.perf_counter() - started,
            stderr_tail=stderr.text(),
            failure=f"timeout: still running after runner.timeout_s = {request.timeout_s:g} s; "
            "killed with the processes it started",
        )
    if result.state != FAILED:
        return result
    worker.join(timeout=5)  # it exits once it has answered; then its stderr is complete
    _kill_group(worker)
    return replace(result, stderr_tail=stderr.text())


def _reap(worker) -> None:
    """Kill what is left of a worker's process group and wait for the worker to end."""
    _kill_group(worker)
    worker.join(timeout=5)
    if worker.exitcode is None:
        worker.kill()
        worker.join()


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C that comes while the block runs, and raise it right after: a worker is never
    half started, so the study always knows its pid and can end it (the worker ignores SIGINT; the
    study ends it).

    Python runs signal handlers in the main thread whichever thread the kernel gave the signal to,
    so a handler that only notes the signal holds it even while other threads (heartbeats, the
    memory watchdog, stderr readers) run; blocking SIGINT in this thread would not, since the
    kernel hands a blocked signal to another thread. Outside the main thread nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


STDERR_KEPT_BYTES = 64_000
"""How much of a worker's stderr is kept (its end): enough for a traceback and a fault dump."""


class _StderrTail:
    """A pipe for a worker's stderr, read by a thread that keeps only the last
    ``STDERR_KEPT_BYTES``: the worker may write without limit, and nothing grows."""

    def __init__(self) -> None:
        self._read_fd, self.write_fd = os.pipe()
        self._kept = bytearray()
        self._reader = threading.Thread(target=self._read, name="worker-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Read to the pipe's end, then close it: the reader owns the read end, so a pipe a
        process the worker started still holds open is closed when that process ends, not
        leaked."""
        try:
            while True:
                try:
                    chunk = os.read(self._read_fd, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                self._kept += chunk
                if len(self._kept) > 2 * STDERR_KEPT_BYTES:
                    del self._kept[:-STDERR_KEPT_BYTES]
        finally:
            os.close(self._read_fd)

    def close_writer(self) -> None:
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def text(self, wait_s: float = 2.0) -> str:
        """The last lines written, once the pipe is read to its end (waiting up to ``wait_s``)."""
        self._reader.join(timeout=wait_s)
        return _tail_lines(bytes(self._kept[-STDERR_KEPT_BYTES:]))

    def close(self) -> None:
        self.close_writer()
        self._reader.join(timeout=1.0)
        # A reader still alive: a process the worker started holds the pipe open; the reader
        # (a daemon thread) closes its end when that process is gone.


def _kill_group(worker) -> None:
    """SIGKILL the worker's process group (the group keeps its id while any process in it lives).
    A worker that exited may already be reaped by the fork server; Linux hands out pids in turn,
    so its id is not reused by another process within the moments this takes."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no group yet (not started, or before setpgid)
        if worker.exitcode is None:
            worker.kill()


class _InheritedFd:
    """A file descriptor handed to a worker the way multiprocessing hands it a pipe's end (through
    the fork server, or kept open across ``spawn``)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _adopt_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _adopt_fd(duplicate) -> int:
    return duplicate.detach()


def _tail_lines(data: bytes) -> str:
    """The last lines of a worker's stderr, without blank lines."""
    text = data.decode("utf-8", errors="replace")
    # faulthandler's list of loaded extension modules is one very long line that says nothing here
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("Extension modules:")
    ]
    tail = lines[-STDERR_TAIL_LINES:]
    # faulthandler's dump of every thread can push its own first line, what killed the worker,
    # out of the tail: keep it in front
    fatal = next((line for line in lines if line.startswith("Fatal Python error")), None)
    if fatal is not None and fatal not in tail:
        tail = [fatal, *tail[1:]]
    return "\n".join(tail)


_CAUSE = re.compile(r"error|terminate called|what\(\)", re.IGNORECASE)
"""A line that says why native code aborted (``terminate called after throwing ...``, ``what():
CUDA error: ...``, a Python exception printed before it)."""


def _headline(tail: str) -> str:
    """One line from a dead worker's stderr: a fatal error with the innermost frame (faulthandler's
    dump) and, where one precedes it, the line that says why (an abort in native code is not
    its own reason); else the last line."""
    lines = tail.splitlines()
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is None:
        return lines[-1][:300] if lines else ""
    current = next(
        (i for i in range(fatal, len(lines)) if lines[i].startswith("Current thread")), fatal
    )
    frame = next((line.strip() for line in lines[current:] if line.strip().startswith("File ")), "")
    cause = next((line.strip() for line in reversed(lines[:fatal]) if _CAUSE.search(line)), "")
    return (
        f"{lines[fatal]}"
        + (f" ({frame})" if frame else "")
        + (f", after: {cause[:300]}" if cause else "")
    )


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even by ``kill -9``. A worker's parent is
    the fork server (the study, with ``spawn``), and the server's is the study: a hung trial would
    otherwise outlive the study and hold its device forever."""
    parent_pid = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the worker ends when it next writes to the study
    if os.getppid() != parent_pid or not _study_alive():
        os._exit(1)  # the parent died before prctl took effect


def _study_alive() -> bool:
    """Whether the study process that asked for this worker still runs (true outside a worker).
    Its pid, not ``parent_process().is_alive()``: that reads the pipe the fork server's child was
    handed its task through, which is at its end once the task is read."""
    study = multiprocessing.parent_process()
    if study is None or study.pid is None:
        return True
    try:
        os.kill(study.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        pass
    return True


def _worker(request: TrialRequest, send, stderr_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent()
    os.setpgid(0, 0)  # a group of its own: a timeout kills whatever the workload started, too
    os.dup2(stderr_fd, 2)  # C and Python output alike
    os.close(stderr_fd)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable()  # a segfault or abort leaves a Python traceback in that tail
    _thread_lock_for_progress_bars()
    lock = threading.Lock()
    sent: list[bool] = []

    def answer(result: TrialResult, then_exit: bool = False) -> None:
        with lock:
            if not sent:
                send.send(result)
                sent.append(True)
            if then_exit:
                os._exit(0)

    answer(run_trial(request, on_memory_exceeded=lambda result: answer(result, then_exit=True)))
    send.close()


def _thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock before torch's compiler draws its progress bars. tqdm builds a
    multiprocessing lock for them otherwise: a named semaphore registered with the study's
    resource tracker, which a worker killed or ended by ``os._exit`` never unregisters, so a run
    that compiled ended with "resource_tracker: There appear to be 32 leaked semaphore objects to
    clean up at shutdown" (the default ``llm`` run on the CPU). A worker's bars are its own."""
    try:
        from tqdm import tqdm
    except ImportError:  # torch draws no bars without it
        return
    tqdm.set_lock(threading.RLock())


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:  # a real-time signal has no name
            name = str(-exitcode)
        hint = " (often the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
        return f"killed by signal {name}{hint}"
    return f"exited with code {exitcode}"
