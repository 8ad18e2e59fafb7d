"""Environment and contention readings on this host."""

from __future__ import annotations

import os

import torch

from search.measurement.environment import MemoryProbe, contention, environment

CPU = torch.device("cpu")


def test_environment_names_device_versions_and_the_tools_commit():
    env = environment(CPU)
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert int(env["cpu_count"]) == os.cpu_count()
    assert "search_git_commit" in env  # this checkout is a git repository


def test_a_busy_cpu_is_reported(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0 * cores, 0.0, 0.0))
    (warning,) = contention(CPU)
    assert "CPU is busy" in warning
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert contention(CPU) == []


def test_memory_probe_sees_an_allocation_on_cpu():
    probe = MemoryProbe(CPU)
    probe.start()
    block = torch.ones(50_000_000 // 4)  # 50 MB, touched
    peak = probe.peak_mb()
    del block
    assert peak is not None and peak >= 45
