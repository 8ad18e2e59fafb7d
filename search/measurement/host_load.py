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
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUSY_SHARE", "CpuMark", "cpu_mark", "others_busy_cores"]

BUSY_SHARE = 0.25
"""Share of the cores other processes keep busy above which the machine is busy. Lower than the
half per core the load average was held to: while the tool computes on every core, another
process gets only its share of them (a neighbour spinning on one of 2 cores beside a study's 2
threads reads about 0.6 cores), and an idle machine's background reads under 0.1."""

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuMark:
    """The machine's and this process tree's CPU seconds at one moment."""

    machine_busy_s: float
    """Busy CPU time of every core since boot: user, nice, system, irq, softirq and steal."""
    own_s: float
    """CPU time of this process and its live descendants, each with its reaped children's."""
    at_s: float
    """``time.monotonic()`` when read."""


def cpu_mark() -> CpuMark | None:
    """The CPU seconds now, or None where ``/proc`` cannot be read (not Linux)."""
    try:
        first = (_PROC / "stat").read_text().split("\n", 1)[0].split()
        ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
        own = _tree_ticks(os.getpid())
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return CpuMark(busy / _TICKS_PER_S, own / _TICKS_PER_S, time.monotonic())


def others_busy_cores(since: CpuMark | None) -> float:
    """How many cores other processes kept busy on average since ``since``: the machine's busy
    time less this process tree's, over the time between. Where there is no mark, the 1-minute
    load average, which counts this process too."""
    now = cpu_mark()
    if since is None or now is None or now.at_s <= since.at_s:
        return os.getloadavg()[0]
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
