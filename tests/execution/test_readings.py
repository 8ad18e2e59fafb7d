"""Device readings over the timed windows: energy per item with its interval, clocks, throttling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from search.execution.readings import telemetry_metrics


def window(energy_j, throttled=False, duration_s=1.0):
    return SimpleNamespace(
        energy_j=energy_j,
        duration_s=duration_s,
        sm_clock_mhz=1500.0,
        mem_clock_mhz=2600.0,
        gpu_util_pct=99.0,
        temperature_c=60.0,
        throttled=throttled,
    )


def test_energy_per_item_comes_from_every_window_with_an_upper_bound():
    m = telemetry_metrics(
        [window(100.0), window(110.0), window(90.0)], items_per_window=1000, confidence=0.95
    )
    assert m["energy_per_item_j"] == pytest.approx(0.1)
    # t(0.975, 2 df) * sd(0.1, 0.11, 0.09) / sqrt(3)
    assert m["energy_per_item_j_ci_high"] == pytest.approx(0.1 + 4.303 * 0.01 / 3**0.5, rel=1e-3)
    assert m["mean_power_w"] == pytest.approx(100.0) and m["throttled"] == 0.0


def test_a_window_without_an_energy_reading_means_no_energy_figure_not_a_zero():
    m = telemetry_metrics([window(100.0), window(None)], items_per_window=1000, confidence=0.95)
    assert "energy_per_item_j" not in m and m["sm_clock_mhz"] == 1500.0


def test_throttling_in_any_window_is_reported():
    assert (
        telemetry_metrics([window(1.0), window(1.0, throttled=True)], 10, 0.95)["throttled"] == 1.0
    )
