"""How busy other processes keep this machine's CPUs, the tool's own processes left out.

The 1-minute load average counted the tool's own work: on an idle 2-core machine, a study's
start-up (its imports and its fork server's) and the invocation before it read 1.1, above the 0.5
per core at which the CPU was called busy. So every invocation warned of a busy CPU and measured
the peak again, as measured under load. Here the machine's busy CPU time (``/proc/stat``) is
taken between two marks, less what this process and its descendants (the fork server, the
trials) used meanwhile: what is left is the others'.

Read from ``/proc`` rather than through psutil: it is Linux's own accounting, a few lines, and
the GPU machines this runs on install from a wheel folder without a package index, where each
dependency is one more wheel to carry. Where ``/proc`` cannot be read, the load average stands in.

Only the cores this process may run on count (``usable_cores``: its affinity, which ``taskset``
and a container's cpuset set): a study pinned to 2 of 16 cores read the host's other 14, so a
neighbour on cores it never touched called it busy, and one on its own 2 cores read 1 core busy
of 16, under the bar.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUSY_SHARE",
    "LOAD_SHARE",
    "Busyness",
    "CpuMark",
    "busyness",
    "cpu_mark",
    "others_busy_cores",
    "usable_cores",
]

BUSY_SHARE = 0.25
"""Share of the cores other processes keep busy above which the machine is busy. Lower than the
half per core the load average was held to: while the tool computes on every core, another
process gets only its share of them (a neighbour spinning on one of 2 cores beside a study's 2
threads reads about 0.6 cores), and an idle machine's background reads under 0.1."""

LOAD_SHARE = 0.5
"""The 1-minute load average per core above which the machine is busy where ``/proc`` cannot be
read (not Linux): that figure counts this process too, hence the higher bar."""

_PROC = Path("/proc")
_clock = time.monotonic
"""When a mark is read (a name of this module's own, so that a test can set the time between two
marks without setting the interpreter's clock)."""
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuMark:
    """The machine's and this process tree's CPU seconds at one moment."""

    machine_busy_s: float
    """Busy CPU time of the usable cores since boot: user, nice, system, irq, softirq and
    steal."""
    own_s: float
    """CPU time of this process and its live descendants, each with its reaped children's."""
    at_s: float
    """``time.monotonic()`` when read."""


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity; every core where that cannot be read)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_mark() -> CpuMark | None:
    """The CPU seconds now, of the cores this process may run on (``usable_cores``), or None
    where ``/proc`` cannot be read (not Linux)."""
    cores = {f"cpu{i}" for i in usable_cores()}
    try:
        lines = (_PROC / "stat").read_text().splitlines()
        busy = sum(_busy_ticks(line.split()) for line in lines if line.split(" ", 1)[0] in cores)
        own = _tree_ticks(os.getpid())
    except (OSError, ValueError, IndexError):
        return None
    return CpuMark(busy / _TICKS_PER_S, own / _TICKS_PER_S, _clock())


def _busy_ticks(fields: list[str]) -> int:
    """A ``/proc/stat`` cpu line's busy ticks: all but idle and iowait."""
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4]


@dataclass(frozen=True)
class Busyness:
    """How many cores were kept busy, and by what reading."""

    cores_busy: float
    by_others: bool
    """True: other processes' CPU time (``/proc``); False: the 1-minute load average."""

    def busy(self) -> bool:
        share = BUSY_SHARE if self.by_others else LOAD_SHARE
        return self.cores_busy > share * len(usable_cores())

    def said(self) -> str:
        cores = len(usable_cores())
        if self.by_others:
            return f"other processes kept {self.cores_busy:.1f} of {cores} cores busy"
        return f"1-minute load average {self.cores_busy:.1f} on {cores} cores"


def busyness(since: CpuMark | None) -> Busyness:
    """How busy other processes kept the CPU since ``since`` (``others_busy_cores``); where it
    cannot be read, the 1-minute load average, which counts this process too."""
    others = others_busy_cores(since)
    return Busyness(os.getloadavg()[0], False) if others is None else Busyness(others, True)


def others_busy_cores(since: CpuMark | None) -> float | None:
    """How many cores other processes kept busy on average since ``since``: the machine's busy
    time less this process tree's, over the time between; None where it cannot be read."""
    now = cpu_mark()
    if since is None or now is None or now.at_s <= since.at_s:
        return None
    others_s = (now.machine_busy_s - since.machine_busy_s) - (now.own_s - since.own_s)
    return max(0.0, others_s / (now.at_s - since.at_s))


def _tree_ticks(root: int) -> int:
    """CPU ticks of ``root`` and every live descendant, each counting its reaped children."""
    parent_of: dict[int, int] = {}
    ticks_of: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after the command, which may hold spaces
        pid = int(entry.name)
        parent_of[pid] = int(fields[1])
        ticks_of[pid] = sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks_of.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total
