"""Measuring one configuration: timers (``timers``), the timing protocol (``protocol``) and its
statistics (``statistics``), GPU telemetry (``nvml``), energy (``energy``, with the stand-in of
``monitor``), the host and its memory (``environment``; a CPU step's tensors at their peak:
``tensor_peak``), the device's peaks (``peak``).

Exported: what the packages above use. Nothing here imports Optuna or MLflow, and the worker
process imports every module of it anyway, so the names are imported eagerly."""

from search.measurement.energy import energy_unavailable_reason, make_monitor
from search.measurement.environment import (
    MemoryProbe,
    contention,
    device_label,
    environment,
    rss_bytes,
)
from search.measurement.nvml import SLOWDOWN_NAMES
from search.measurement.peak import PEAKS_FILE, Beaten, Peak, device_peak, measure_beaten
from search.measurement.protocol import Measurement, MeasureSettings, measure
from search.measurement.statistics import summarize, t_interval, t_quantile
from search.measurement.timers import make_timer

__all__ = [
    "PEAKS_FILE",
    "SLOWDOWN_NAMES",
    "Beaten",
    "MeasureSettings",
    "Measurement",
    "MemoryProbe",
    "Peak",
    "contention",
    "device_peak",
    "device_label",
    "energy_unavailable_reason",
    "environment",
    "make_monitor",
    "make_timer",
    "measure",
    "measure_beaten",
    "rss_bytes",
    "summarize",
    "t_interval",
    "t_quantile",
]
