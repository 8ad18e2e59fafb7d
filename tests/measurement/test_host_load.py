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
