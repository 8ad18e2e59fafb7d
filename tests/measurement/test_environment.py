"""Environment and contention readings on this host."""

from __future__ import annotations

import os

import torch

from search.measurement import host_load
from search.measurement.environment import MemoryProbe, contention, environment
from search.measurement.host_load import cpu_mark

CPU = torch.device("cpu")


def test_environment_names_device_versions_and_the_tools_commit():
    env = environment(CPU)
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert int(env["cpu_count"]) == os.cpu_count()
    assert "search_git_commit" in env  # this checkout is a git repository


def test_a_cpu_that_others_keep_busy_is_reported(monkeypatch):
    cores = os.cpu_count() or 1
    since = cpu_mark()
    seen = []
    monkeypatch.setattr(
        host_load, "others_busy_cores", lambda mark: seen.append(mark) or 0.5 * cores
    )
    (warning,) = contention(CPU, since)
    assert "CPU is busy (other processes kept" in warning and seen == [since]
    monkeypatch.setattr(host_load, "others_busy_cores", lambda mark: 0.05)
    assert contention(CPU, since) == []
    # where /proc cannot be read, the load average, held to half the cores (it counts this process)
    monkeypatch.setattr(host_load, "others_busy_cores", lambda mark: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.4 * cores, 0.0, 0.0))
    assert contention(CPU, since) == []


def test_memory_probe_sees_an_allocation_on_cpu():
    probe = MemoryProbe(CPU)
    probe.start()
    block = torch.ones(50_000_000 // 4)  # 50 MB, touched
    peak = probe.peak_mb()
    del block
    assert peak is not None and peak >= 45


def test_a_settled_probe_counts_the_held_bytes_and_what_comes_after_not_what_came_before():
    probe = MemoryProbe(CPU)
    probe.start()
    building = torch.ones(200_000_000 // 4)  # 200 MB that building used and gave back
    del building
    probe.settle(held_bytes=10_000_000)
    block = torch.ones(50_000_000 // 4)  # 50 MB, touched
    peak = probe.peak_mb()
    del block
    # 10 MB held and 50 MB after; before the settle, the 200 MB would count
    assert peak is not None and 55 <= peak <= 120
