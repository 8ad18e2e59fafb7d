"""Every study's control runs on this machine, kept in the runs directory: the history that gives a
study's first invocation the machine's between-invocation spread."""

from __future__ import annotations

import math
import os
from dataclasses import replace

from search.analysis.noise_floor import RunFigures
from search.storage.machine_runs import (
    MACHINE_RUNS,
    MAX_SESSIONS,
    keep_machine_run,
    machine_sessions,
)

CONTROL = {"batch_size": 4, "micro_batch_size": 1}


def _runs(session: str, start: float, device: str = "n1 cpu", n: int = 3) -> list[RunFigures]:
    return [
        RunFigures(
            time_s=start + 60 * i,
            throughput=1e4 + i,
            cv=0.01,
            n_windows=10,
            n_steps=50,
            stalls=0,
            session=session,
            device=device,
            probe=500.0,
            probe_cv=0.02,
            probe_windows=5,
            probe_steps=50,
            busy=0.1,
            others_busy=0.0,
        )
        for i in range(n)
    ]


def test_the_other_studies_sessions_on_this_device_are_read_with_whether_their_control_is_ours(
    tmp_path,
):
    mine = _runs("a", 5e9)  # the others ended before this study's last control run
    kept = {
        "a": ("fp1", CONTROL, mine),  # this study's own: in its storage already
        "b": ("fp1", CONTROL, _runs("b", 2e9)),  # another study of the same workload
        "c": ("fp2", {"batch_size": 8}, _runs("c", 3e9)),  # another workload
        "d": ("fp1", CONTROL, _runs("d", 4e9, device="n1 cuda:0 GPU-x")),  # another device
    }
    for fingerprint, control, runs in kept.values():
        for run in runs:
            keep_machine_run(tmp_path, fingerprint, control, run)
    with (tmp_path / MACHINE_RUNS).open("a") as f:
        f.write('{"fingerprint": "fp1", "control": "{}", "run": {"time_s": 5e9, "thro')  # killed
    sessions = machine_sessions(tmp_path, mine)
    assert [(s.runs[0].session, s.same_control) for s in sessions] == [("b", True), ("c", False)]
    assert sessions[0].runs == tuple(kept["b"][2])  # every figure as it was kept
    assert machine_sessions(tmp_path / "nowhere", mine) == []


def test_only_the_newest_sessions_are_history(tmp_path):
    for i in range(MAX_SESSIONS + 5):
        for run in _runs(f"s{i}", 1e9 + 1e6 * i, n=2):
            keep_machine_run(tmp_path, "fp1", CONTROL, run)
    sessions = machine_sessions(tmp_path, _runs("now", 2e9, n=1))
    assert len(sessions) == MAX_SESSIONS
    assert sessions[0].runs[0].session == "s5" and sessions[-1].runs[0].session == f"s{34}"


def test_a_session_measured_beside_other_work_is_no_history_for_another_study(tmp_path):
    cores = os.cpu_count() or 1
    quiet = [replace(r, others_busy=0.05) for r in _runs("quiet", 1e9)]
    loaded = _runs("loaded", 2e9)
    loaded[1] = replace(loaded[1], others_busy=0.3 * cores)  # one run beside a neighbour
    unknown = [replace(r, others_busy=math.nan) for r in _runs("unknown", 3e9)]  # not measured
    for run in quiet + loaded + unknown:
        keep_machine_run(tmp_path, "fp1", CONTROL, run)
    sessions = machine_sessions(tmp_path, _runs("now", 4e9, n=1))
    assert [s.runs[0].session for s in sessions] == ["quiet", "unknown"]


def test_a_later_session_and_a_line_kept_after_a_cut_one_are_read_as_the_file_grows(tmp_path):
    """The file is parsed again when it changes; a line a kill cut short does not hide the lines
    after it; a session that ended after the study's last control run is not its history (a
    study judged again later reads what it could read then)."""
    mine = _runs("mine", 2e9)
    for run in _runs("before", 1e9):
        keep_machine_run(tmp_path, "fp1", CONTROL, run)
    assert [s.runs[0].session for s in machine_sessions(tmp_path, mine)] == ["before"]
    with (tmp_path / MACHINE_RUNS).open("a") as f:
        f.write('{"fingerprint": "fp1", "control": "{}", "ru')  # cut short, no newline
    for run in _runs("also-before", 1.5e9):
        keep_machine_run(tmp_path, "fp1", CONTROL, run)
    for run in _runs("after", 3e9):
        keep_machine_run(tmp_path, "fp1", CONTROL, run)
    sessions = machine_sessions(tmp_path, mine)
    assert [s.runs[0].session for s in sessions] == ["before", "also-before"]
    assert len(sessions[1].runs) == 3  # none lost to the cut line before them
