"""Device readings over a measurement's timed windows: energy, clocks, utilisation, throttling.

``MonitoredTimer`` reads an energy/clock monitor (``search.measurement.energy``) inside each timed
window; ``telemetry_metrics`` turns those readings into a trial's figures.
"""

from __future__ import annotations

import numpy as np

from search.measurement.statistics import t_interval

__all__ = ["MonitoredTimer", "telemetry_metrics"]


class MonitoredTimer:
    """A timer that also reads an energy/clock monitor over each window, inside the timer's
    synchronisation points, so the monitor sees exactly the timed work."""

    def __init__(self, timer, monitor):
        self.timer, self.monitor, self.windows = timer, monitor, []

    def now_s(self) -> float:
        return self.timer.now_s()

    def begin_window(self) -> None:
        # The monitor first: its host-side work (NVML reads, a polling thread) must not fall inside
        # the timed window. The device is idle here, as the previous window ended synchronised.
        self.monitor.begin_window()
        self.timer.begin_window()

    def mark_step(self) -> None:
        self.timer.mark_step()

    def end_window(self) -> list[float]:
        durations = self.timer.end_window()
        self.windows.append(self.monitor.end_window())
        return durations

    def close(self) -> None:
        self.monitor.close()


def telemetry_metrics(windows, items_per_window: int, confidence: float) -> dict[str, float]:
    """Energy per item (mean and upper interval bound over windows) and device readings.

    Energy is reported only when every timed window has a reading: a window the counter did not
    cover would bias the mean, and a zero would be invented.
    """
    if not windows:
        return {}
    out: dict[str, float] = {}
    energies = [w.energy_j for w in windows]
    if all(e is not None for e in energies):
        energy = t_interval(np.array(energies) / items_per_window, confidence)
        out |= {
            "energy_per_item_j": energy.mean,
            "energy_per_item_j_ci_high": energy.high,
            "mean_power_w": float(sum(energies) / sum(w.duration_s for w in windows)),
        }
    for key, reduce in (
        ("sm_clock_mhz", np.mean),
        ("mem_clock_mhz", np.mean),
        ("gpu_util_pct", np.mean),
        ("temperature_c", np.max),
    ):
        values = [getattr(w, key, None) for w in windows]
        known = [v for v in values if v is not None]
        if known and len(known) == len(values):  # a reading from every window, or none at all
            out[key] = float(reduce(known))
    if any(hasattr(w, "throttled") for w in windows):
        out["throttled"] = float(any(getattr(w, "throttled", False) for w in windows))
        # Holding the board's power limit is reported, not held against stability
        # (search.measurement.nvml).
        out["power_capped"] = float(
            np.mean(["sw_power_cap" in getattr(w, "throttle_reasons", ()) for w in windows])
        )
    return out
