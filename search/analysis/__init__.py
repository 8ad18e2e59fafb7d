"""Judging measurements: the machine's noise floor and its drift (``noise_floor``, ``drift``,
``between_sessions``), what one run keeps (``run_figures``), the Pareto front and the SLO
(``pareto``), racing (``racing``), the regime (``diagnosis``, against the device's peak of
``search.measurement.peak``). Whether a measurement is stable
against that floor is ``search.stability``.

Exported: what the packages above use. Every module here is light (no Optuna, no MLflow, no
Hydra), so the worker process that imports ``search.execution`` pays little for importing them
all."""

from search.analysis.diagnosis import (
    Diagnosis,
    count_work,
    diagnose,
    doubling,
    work_metrics,
)
from search.analysis.noise_floor import MIN_BETWEEN_DF, NoiseFloor, by_device
from search.analysis.pareto import (
    check_slo,
    closest_to_slo,
    constraint_values,
    meets_slo,
    pareto_mask,
)
from search.analysis.racing import Race, Samples, can_race, out_of_reach, race_against
from search.analysis.run_figures import (
    BUSY,
    MICRO_BATCH_PHASE,
    STALL_FACTOR,
    RunFigures,
    busy_class,
    median_busy,
    micro_batch_metrics,
    stall_steps,
)

__all__ = [
    "BUSY",
    "MICRO_BATCH_PHASE",
    "MIN_BETWEEN_DF",
    "STALL_FACTOR",
    "Diagnosis",
    "NoiseFloor",
    "Race",
    "RunFigures",
    "Samples",
    "busy_class",
    "by_device",
    "can_race",
    "check_slo",
    "closest_to_slo",
    "constraint_values",
    "count_work",
    "diagnose",
    "doubling",
    "meets_slo",
    "median_busy",
    "micro_batch_metrics",
    "out_of_reach",
    "pareto_mask",
    "race_against",
    "stall_steps",
    "work_metrics",
]
