"""Each trial in a fresh worker process: a worker that dies is a crash with its signal or exit code
and the tail of its stderr, one that hangs is a timeout killed with its process group, and none
outlives the study or loses a Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_overrides import TINY_GPT
from trial_workloads import (
    QUICK,
    HeavyWhenCounted,
    Layers,
    Segfaults,
    Wide,
    faulty,
    request,
    target,
)

from search.analysis.memory_model import GRADIENTS
from search.config.contract import read_contract
from search.core.records import COMPLETE, FAILED, fault_kind
from search.execution.isolation import _headline, run_in_a_worker, run_isolated
from search.execution.trial import TrialRequest

TESTS = Path(__file__).resolve().parents[1]
"""tests/: the shared helpers, among them the failing workload faults.Faulty."""


def test_isolated_worker_that_segfaults_is_a_crash_and_the_caller_survives():
    result = run_isolated(request(target(Segfaults)))
    assert result.state == FAILED and result.failure.startswith(
        "crash: worker killed by signal SIGSEGV; stderr: "
    )
    # faulthandler's dump names the fault and the frame that caused it
    assert "Segmentation fault" in result.failure and "in build_model" in result.failure
    assert "Extension modules" not in result.stderr_tail and "build_model" in result.stderr_tail


def test_worker_that_exits_is_a_crash_with_its_code_and_last_stderr_line():
    result = run_isolated(faulty("exit"))
    assert (
        result.failure
        == "crash: worker exited with code 3; stderr: faults: giving up with exit code 3"
    )


def test_worker_that_aborts_is_a_crash_with_the_signal():
    result = run_isolated(faulty("abort"))
    assert (
        result.failure.startswith("crash: worker killed by signal SIGABRT")
        and "Aborted" in result.failure
    )


def test_exception_keeps_its_traceback_in_the_stderr_tail():
    result = run_isolated(faulty("error"))
    assert result.failure == "error: RuntimeError: injected: the batch has the wrong shape"
    assert "Traceback" in result.stderr_tail and "faults.py" in result.stderr_tail


def test_a_worker_that_dies_halfway_through_its_answer_is_a_crash():
    # The pipe reads "got end of file during message" (OSError), not EOFError.
    result = run_isolated(faulty("cut"))
    assert result.state == FAILED and result.failure.startswith("crash: worker exited with code 0")


def test_a_worker_that_writes_without_end_keeps_only_the_end_of_its_stderr(tmp_path):
    started = time.monotonic()
    result = run_isolated(faulty("chatty"))
    assert result.failure == "error: ValueError: injected: failed after a long log"
    assert "Traceback" in result.stderr_tail and result.stderr_tail.endswith(
        "ValueError: injected: failed after a long log"
    )
    assert len(result.stderr_tail) < 64_000
    assert time.monotonic() - started < 60


def test_hung_trial_is_a_timeout_and_its_process_group_dies_with_it(tmp_path):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    result = run_isolated(faulty("hang", pid_file=str(pid_file), timeout_s=8))
    assert 8 <= time.monotonic() - started < 20
    assert result.state == FAILED and fault_kind(result.failure) == "timeout", result.failure
    assert "runner.timeout_s = 8 s" in result.failure
    _, child = map(int, pid_file.read_text().split())  # the hung workload's own child process
    if not _ends(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the workload's child process outlived the timeout")


def _ends(pid: int, within_s: float = 5.0) -> bool:
    for _ in range(int(within_s / 0.1)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state


def test_a_worker_dies_with_its_study_process_even_under_kill_9(tmp_path):
    pid_file = tmp_path / "pids"
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from search.execution.isolation import run_isolated\n"
        "from search.execution.trial import TrialRequest\n"
        "from search.measurement.protocol import MeasureSettings\n"
        "if __name__ == '__main__':\n"
        "    run_isolated(TrialRequest(\n"
        "        workload={'_target_': 'faults.Faulty', 'pid_file': sys.argv[2]},\n"
        "        config={'batch_size': 4, 'fault': 'hang'}, device='cpu', seed=0,\n"
        "        measure=MeasureSettings()))\n"
    )
    (tmp_path / "study.py").write_text(script)
    study = subprocess.Popen(
        [sys.executable, str(tmp_path / "study.py"), str(TESTS), str(pid_file)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    # Starting the fork server and the worker imports torch twice: seconds when idle, and over
    # half a minute on 2 cores shared with the rest of the suite; the wait is not what is tested.
    deadline = time.monotonic() + 180
    while not (pid_file.exists() and len(pid_file.read_text().split()) == 2):
        if study.poll() is not None:
            pytest.fail(
                f"the study process exited with {study.returncode} before its worker started"
            )
        if time.monotonic() > deadline:
            study.kill()
            pytest.fail("the worker did not start within 180 s")
        time.sleep(0.1)
    worker, child = map(int, pid_file.read_text().split())
    # the fork server that started the worker (the study itself under spawn)
    server = _parent_of(worker)
    study.kill()
    study.wait()
    try:
        assert _ends(worker), "the worker outlived the study process"
        assert server == study.pid or _ends(server), "the fork server outlived the study process"
    finally:
        os.kill(child, signal.SIGKILL)  # the workload's own child is the workload's business


def test_host_memory_above_the_limit_is_oom_and_stops_the_trial_early():
    started = time.monotonic()
    result = run_isolated(faulty("hostmem", memory_limit_mb=200))
    assert result.state == FAILED and result.failure.startswith("oom: host memory "), result.failure
    # held while building: the cap before the step settles (``UNSETTLED_CAP``)
    assert "before the step settled" in result.failure
    assert "runner.memory_limit_mb = 200 MB" in result.failure
    assert 656 < result.peak_memory_mb < 1000  # stopped within a few 50 MB steps, not at 20 GB
    assert time.monotonic() - started < 30


def test_the_memory_limit_holds_the_measured_step_not_its_work_count():
    """The work count runs the step eagerly under a counting mode, which can take more than the
    configuration (a compiled llama step peaked at 34 MB, its count over 52)."""
    req = replace(request(target(HeavyWhenCounted)), memory_limit_mb=60)
    result = run_isolated(req)
    assert result.state == COMPLETE, result.failure
    assert result.peak_memory_mb < 60


def test_isolated_trials_each_report_their_own_peak_memory_the_same_to_the_byte():
    """On a CPU with one lane the peak is the step's tensors' (``tensor_peak``): the resident set
    of one configuration moved by 10% between processes."""
    results = [run_isolated(request(target(Layers))) for _ in range(2)]
    peaks = [r.peak_memory_mb for r in results]
    assert all(p is not None and p >= 60 for p in peaks), peaks
    assert peaks[0] == peaks[1]
    # 256 layers of 128 x 128 weights and 128 biases, fp32: their gradients
    assert all(r.held[GRADIENTS] == 256 * (128 * 128 + 128) * 4 / 1e6 for r in results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_isolated_cuda_trial_reports_allocator_peak():
    req = TrialRequest(
        workload=target(Wide), config={"batch_size": 4}, device="cuda", seed=0, measure=QUICK
    )
    result = run_isolated(req)
    assert result.state == COMPLETE, result.failure
    assert result.peak_memory_mb >= 60


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_limit_is_a_real_allocator_oom():
    # Wide holds about 67 MB of weights, gradients and AdamW state: a 20 MB cap cannot hold it
    result = run_isolated(
        TrialRequest(
            workload=target(Wide),
            config={"batch_size": 4},
            device="cuda",
            seed=0,
            measure=QUICK,
            memory_limit_mb=20,
        )
    )
    assert result.state == FAILED and result.failure.startswith("oom: "), result.failure
    assert "memory" in result.failure.lower()
    roomy = run_isolated(
        TrialRequest(
            workload=target(Wide),
            config={"batch_size": 4},
            device="cuda",
            seed=0,
            measure=QUICK,
            memory_limit_mb=2000,
        )
    )
    assert roomy.state == COMPLETE, roomy.failure


def test_a_worker_killed_by_a_real_time_signal_is_a_crash_not_a_traceback():
    from search.execution.isolation import _exit_text

    realtime = int(signal.SIGRTMIN) + 6  # no name in signal.Signals
    assert _exit_text(-realtime) == f"killed by signal {realtime}"
    assert _exit_text(-signal.SIGKILL).startswith("killed by signal SIGKILL")


def test_ctrl_c_while_the_worker_starts_is_not_lost(monkeypatch):
    from search.execution.isolation import worker_context

    process_class = worker_context().Process
    start = process_class.start

    def start_during_ctrl_c(self):
        # the user's Ctrl-C, in the moment the worker is started
        os.kill(os.getpid(), signal.SIGINT)
        return start(self)

    monkeypatch.setattr(process_class, "start", start_during_ctrl_c)
    # A shell starts background jobs with SIGINT ignored; Ctrl-C handling needs Python's handler.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        try:
            run_isolated(faulty("hang", timeout_s=60))
        finally:
            signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 30  # raised at once, not after the hang's timeout


def test_ctrl_c_while_the_worker_starts_waits_for_the_start_even_with_other_threads(monkeypatch):
    # Heartbeats and watchdogs run in other threads; the kernel hands a SIGINT that the main
    # thread blocks to one of them, and Python then raises it in the main thread at once.
    import threading

    from search.execution.isolation import worker_context

    process_class = worker_context().Process
    start = process_class.start
    started, pids = [], []

    def start_during_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes at which an interrupt can land
            pass
        start(self)
        started.append(True)
        pids.append(self.pid)

    monkeypatch.setattr(process_class, "start", start_during_ctrl_c)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_isolated(faulty("hang", timeout_s=60))
    finally:
        signal.signal(signal.SIGINT, previous)
        stop.set()
    assert started, "the Ctrl-C landed inside the worker's start: a worker the study cannot end"
    # SIGKILLed with the study's interrupt; its parent, the fork server, reaps it when the
    # scheduler next runs that process, which a loaded machine may put off past any fixed wait
    assert _ends(pids[0]), "the worker outlived the study's interrupt"


def test_a_native_abort_is_named_with_the_line_that_says_why():
    tail = "\n".join(
        [
            "terminate called after throwing an instance of 'c10::Error'",
            "  what():  CUDA error: an illegal memory access was encountered",
            "Fatal Python error: Aborted",
            "",
            "Current thread 0x00007f (most recent call first):",
            '  File "/x/search/execution/worker.py", line 102 in _free',
        ]
    )
    line = _headline(tail)
    assert line.startswith("Fatal Python error: Aborted (File ")
    assert line.endswith("after: what():  CUDA error: an illegal memory access was encountered")
    assert _headline("Fatal Python error: Segmentation fault") == (
        "Fatal Python error: Segmentation fault"
    )


def test_the_worker_server_started_early_is_ready_with_torch_once_waited_for():
    """``start_worker_server`` returns at once and ``wait_for_worker_server`` once the server has
    imported torch: a trial, or the peak's measurement, then has the CPU to itself."""
    import multiprocessing.forkserver

    from search.execution.isolation import wait_for_worker_server
    from search.execution.worker_server import start_worker_server, worker_context

    if worker_context().get_start_method() != "forkserver" or not Path("/proc").is_dir():
        pytest.skip("workers are spawned here, or /proc is absent: there is no server to wait for")
    start_worker_server()
    wait_for_worker_server()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    assert pid is not None
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" in maps, "the server has imported torch"


def _what_a_compile_finds_done(send) -> None:
    import sys

    from torch._inductor.codecache import torch_key

    from search.execution._fork_server import _COMPILE_TIME_MODULES

    try:
        torch_key.set(b"")  # refused where the key was computed already
        keyed = False
    except RuntimeError:
        keyed = True
    send.send((keyed, [m for m in _COMPILE_TIME_MODULES if m not in sys.modules]))


def _imported(names, send) -> None:
    import sys

    send.send([n for n in names if n in sys.modules])


def test_a_worker_starts_with_the_modules_its_workload_preloads_and_none_is_left_behind():
    """``serve_workers_with`` restarts the server once with a workload's modules: each worker
    forked after starts with them; a module that cannot be imported is the worker's to meet,
    and the name reaches no later process of this one."""
    import multiprocessing.forkserver

    from search.execution.isolation import worker_context
    from search.execution.worker_server import WORKER_IMPORTS, serve_workers_with

    context = worker_context()
    if context.get_start_method() != "forkserver":
        pytest.skip("workers are spawned here: there is no server to import them")
    wanted = ["xml.dom.minidom", "no_such_module_here"]
    serve_workers_with(wanted)
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    serve_workers_with(wanted[:1])  # the server has it: not started again
    assert multiprocessing.forkserver._forkserver._forkserver_pid == pid
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_imported, args=(wanted, send))
    worker.start()
    assert receive.recv() == ["xml.dom.minidom"]
    worker.join()
    assert worker.exitcode == 0
    assert WORKER_IMPORTS not in os.environ


def test_a_worker_finds_the_compiler_s_once_a_process_work_done_by_the_server():
    """The key of the compiler's cache (a hash of torch's sources) and the modules a compile
    imports are the fork server's, inherited: not redone in each compiled trial's process."""
    from search.execution.isolation import worker_context

    context = worker_context()
    if context.get_start_method() != "forkserver":
        pytest.skip("workers are spawned here: there is no server to inherit from")
    receive, send = context.Pipe(duplex=False)
    worker = context.Process(target=_what_a_compile_finds_done, args=(send,))
    worker.start()
    keyed, missing = receive.recv()
    worker.join()
    assert keyed, "the worker computes the key of the compiler's cache again"
    assert missing == []


_DRAW_A_BAR = """
import multiprocessing, os, sys
from multiprocessing import resource_tracker
multiprocessing.set_start_method("forkserver")  # a worker's default, as the fork server set it
registered = []
resource_tracker.register = lambda name, kind: registered.append(kind)
if sys.argv[1] == "thread-lock":
    from search.execution.isolation import _thread_lock_for_progress_bars
    _thread_lock_for_progress_bars()
from tqdm import tqdm
with open(os.devnull, "w") as nowhere:
    for _ in tqdm(range(3), file=nowhere):
        pass
print(registered)
"""


@pytest.mark.parametrize(
    ("lock", "semaphores"), [("tqdm's", "['semaphore']"), ("thread-lock", "[]")]
)
def test_a_worker_s_progress_bars_take_no_semaphore_the_study_would_count_as_leaked(
    lock, semaphores
):
    """torch's compiler draws tqdm bars in the worker; tqdm's default lock is a multiprocessing
    one, a named semaphore that a killed worker never unregisters, so the study's resource
    tracker warned of dozens leaked at the end of a run that compiled. The worker gives tqdm a
    thread lock first (a fresh interpreter each: tqdm builds its lock once)."""
    drawn = subprocess.run(
        [sys.executable, "-c", _DRAW_A_BAR, lock],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert drawn.stdout.strip() == semaphores


@pytest.mark.parametrize("fault", ["segv", "exit", "error"])
def test_a_workload_read_before_the_study_cannot_take_the_study_with_it(fault):
    # The contract check runs the workload's constructor and build_model: a crash, an exit or an
    # error the meta device could raise too (a RuntimeError) defers the check to the step, and
    # this process goes on. (An error of the code's own is refused: tests/commands/test_cli.py.)
    read = run_in_a_worker(
        read_contract, {"_target_": "faults.Faulty", "fault": fault}, {}, 4, timeout_s=60
    )
    assert read in (None, (None, None))


def test_a_workload_that_hangs_while_read_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "pids"
    settings = {"_target_": "faults.Faulty", "fault": "hang", "pid_file": str(pid_file)}
    started = time.monotonic()
    assert run_in_a_worker(read_contract, settings, {}, 4, timeout_s=3) is None
    assert 3 <= time.monotonic() - started < 30
    _, child = map(int, pid_file.read_text().split())
    if not _ends(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail("the workload's child process outlived the check")


def test_a_workload_that_keeps_the_contract_reads_clean_with_its_parts():
    read = run_in_a_worker(read_contract, TINY_GPT, {}, 2, timeout_s=60)
    assert read == (None, ["attention", "mlp"])
