"""The control runs of every study on this machine, kept in the runs directory beside the peaks
(``control_runs.jsonl``), so that a study's *first* invocation knows how the machine moves between
invocations.

A study keeps its own control runs (``search.storage.repeat_runs``), and from its fourth
invocation its floor knows the between-invocation variance σ_s from them
(``search.analysis.between_sessions``). A new study on a machine that has run others had to start
from nothing, though the machine is the same: its compute probe (a fixed matrix product) is the
same series in every study, and a study of the same workload measures the same control. So every
control run is also appended here, one JSON object a line, and the floor reads the sessions of the
*other* studies as history: they give σ_s, and more degrees of freedom for each class's between-run
spread, from the first invocation on (``search.analysis.noise_floor.NoiseFloor.estimate``).

The newest ``MAX_SESSIONS`` sessions are read: a machine that changed months ago (another
neighbour, a driver) says less about tonight than last week does. A session measured while other
processes kept the machine busy is left out (``_busy``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from search.analysis.noise_floor import RunFigures
from search.measurement.host_load import Busyness

__all__ = ["MACHINE_RUNS", "MAX_SESSIONS", "MachineSession", "keep_machine_run", "machine_sessions"]

MACHINE_RUNS = "control_runs.jsonl"
"""In ``runs_dir``: every study's control runs, one JSON object a line."""
MAX_SESSIONS = 30
"""The newest sessions (invocations) read as history."""


@dataclass(frozen=True)
class MachineSession:
    """The control runs of one invocation of another study on this machine."""

    same_control: bool
    """Whether it measured the same control of the same workload (else only its probes compare)."""
    runs: tuple[RunFigures, ...]


class _Entry(NamedTuple):
    """One line of the file."""

    fingerprint: str
    control: str
    run: RunFigures


def keep_machine_run(
    runs_dir: Path, fingerprint: str, control: Mapping[str, Any], run: RunFigures
) -> None:
    """Append ``run``, a control run of ``control`` under ``fingerprint``, to the machine's file.

    One line a write to a file opened for appending: concurrent studies on the machine do not
    interleave their lines (on a local file system). A file that cannot be written costs the
    history, not the run."""
    line = json.dumps(
        {"fingerprint": fingerprint, "control": _key(control), "run": run.as_dict()},
        default=str,
    )
    # a newline first too: a line a kill cut short ends there and does not swallow this one
    data = ("\n" + line + "\n").encode()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(runs_dir / MACHINE_RUNS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
    except OSError:
        pass


def machine_sessions(runs_dir: Path, own: Sequence[RunFigures]) -> list[MachineSession]:
    """The sessions of this machine's file that are not among ``own`` (the study's control runs),
    on the devices of ``own``, that ended before ``own``'s last run (a study judged again later
    reads what it could read then), the newest ``MAX_SESSIONS``. A session is of the same control
    where it measured the control under the fingerprint that ``own``'s sessions did (known once
    ``own`` has a run here)."""
    if not own:
        return []
    entries = _entries(runs_dir / MACHINE_RUNS)
    mine, devices = {r.session for r in own}, {r.device for r in own}
    until = max(r.time_s for r in own)
    keys = {(e.fingerprint, e.control) for e in entries if e.run.session in mine}
    sessions: dict[str, list[_Entry]] = {}
    for e in entries:  # another device's spread (a GPU beside a CPU) is not this one's
        if e.run.session and e.run.session not in mine and e.run.device in devices:
            sessions.setdefault(e.run.session, []).append(e)
    kept = [
        es
        for es in sessions.values()
        if max(e.run.time_s for e in es) <= until and not any(_busy(e.run) for e in es)
    ]
    newest = sorted(kept, key=lambda es: max(e.run.time_s for e in es))
    return [
        MachineSession(
            same_control=(es[0].fingerprint, es[0].control) in keys,
            runs=tuple(sorted((e.run for e in es), key=lambda r: r.time_s)),
        )
        for es in newest[-MAX_SESSIONS:]
    ]


def _busy(run: RunFigures) -> bool:
    """Whether other processes kept the machine busy during ``run`` (``BUSY_SHARE`` of its cores).

    Such a session stays in its own study's floor, whose figures it measured, but is no history
    for another's: beside other checks on the 2-core test machine the multi-threaded probe ran
    5-18x slower, and one such session set the busy class's between-session spread of every
    later invocation to 61%, its intervals to +-158% (``docs/method/noise-floor.md``)."""
    return not math.isnan(run.others_busy) and Busyness(run.others_busy, True).busy()


def _entries(path: Path) -> tuple[_Entry, ...]:
    """The entries of the readable lines of ``path``, read again only when the
    file changed: the floor is judged at every trial."""
    try:
        stat = path.stat()
    except OSError:
        return ()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: Path, mtime_ns: int, size: int) -> tuple[_Entry, ...]:
    """The lines of ``path`` that hold a whole entry: a line cut short by a kill, or written by
    hand, is skipped rather than failing every floor of the study."""
    try:
        lines = path.read_bytes().decode(errors="replace").splitlines()
    except OSError:
        return ()
    out = []
    for line in lines:
        try:
            e = json.loads(line)
            run = RunFigures.from_dict(e["run"])
            run = replace(run, others_busy=float(run.others_busy), time_s=float(run.time_s))
            out.append(_Entry(str(e["fingerprint"]), str(e["control"]), run))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return tuple(out)


def _key(control: Mapping[str, Any]) -> str:
    return json.dumps(dict(control), sort_keys=True, default=str)
