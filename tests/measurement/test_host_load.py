"""How busy other processes keep the CPU, read from Linux's accounting with this process tree left
out. Each test compares with what ``/proc`` says of the process it started, not with the machine's
speed: the suite runs beside other work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from search.measurement.host_load import busyness, cpu_mark, others_busy_cores

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def test_a_child_s_work_is_this_process_s_own_not_the_others():
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(s=5)])
    try:
        time.sleep(0.3)  # its interpreter started
        before, child_before = cpu_mark(), _cpu_s(child.pid)
        time.sleep(1.0)
        after, child_after = cpu_mark(), _cpu_s(child.pid)
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None
    spun = child_after - child_before
    assert spun > 0.05, "the child ran"
    # one tick of rounding for each of the two readings of the child
    assert after.own_s - before.own_s >= spun - 2 / TICKS


def test_a_process_outside_this_tree_counts_as_the_others():
    # started by a shell that exits at once: the spinner's parent is then not this process
    spinner = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{SPIN.format(s=5)}" >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(spinner.stdout.strip())
    try:
        time.sleep(0.3)
        since, spun_before = cpu_mark(), _cpu_s(pid)
        time.sleep(1.0)
        others = others_busy_cores(since)
        spun = _cpu_s(pid) - spun_before
        elapsed = time.monotonic() - since.at_s
    finally:
        os.kill(pid, 9)
    assert spun > 0.05, "the spinner ran"
    assert others * elapsed >= spun - 4 / TICKS, (others, elapsed, spun)


def test_without_a_mark_the_load_average_stands_in_held_to_half_the_cores(monkeypatch):
    cores = os.cpu_count() or 1
    assert others_busy_cores(None) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4 * cores, 1.0, 1.0))
    read = busyness(None)
    assert not read.by_others and not read.busy() and "1-minute load average" in read.said()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.6 * cores, 1.0, 1.0))
    assert busyness(None).busy()


def _stat(busy_ticks: list[int]) -> str:
    """A ``/proc/stat`` with one line per core, each ``busy_ticks`` user ticks and 1000 idle."""
    per_core = [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(busy_ticks)]
    total = f"cpu  {sum(busy_ticks)} 0 0 {1000 * len(busy_ticks)} 0 0 0 0 0 0"
    return "\n".join([total, *per_core, "intr 0"]) + "\n"


@pytest.mark.parametrize(
    ("busy_cores", "busy"),
    [((2, 3), False), ((0,), True)],  # neighbours on cores it never runs on; one on its own
)
def test_only_the_cores_this_process_may_run_on_count(monkeypatch, tmp_path, busy_cores, busy):
    """Under ``taskset`` or a container's cpuset, a study pinned to cores 0 and 1 of 4 is busy
    where others keep its own cores busy, whatever the host's other cores do."""
    from search.measurement import host_load

    monkeypatch.setattr(host_load, "_PROC", tmp_path)  # no process folders: none of its own time
    monkeypatch.setattr(host_load, "usable_cores", lambda: {0, 1})
    clock = iter([100.0, 101.0])
    monkeypatch.setattr(host_load, "_clock", lambda: next(clock))
    (tmp_path / "stat").write_text(_stat([0, 0, 0, 0]))
    since = cpu_mark()
    (tmp_path / "stat").write_text(_stat([TICKS if i in busy_cores else 0 for i in range(4)]))
    read = busyness(since)
    assert read.cores_busy == pytest.approx(1.0 if busy else 0.0)
    assert read.busy() is busy and "of 2 cores" in read.said()
