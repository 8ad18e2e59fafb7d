"""What a study ended with, as one value: the records with their final verdicts, the front, the
recommendation, the noise floor, the re-validated figures and the regimes, which the files, the
summary and the MLflow runs of ``search.commands.finish`` all show."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from search.analysis.diagnosis import Diagnosis
from search.analysis.noise_floor import NoiseFloor
from search.core.records import TrialRecord
from search.revalidation.pooling import Pooled

__all__ = ["StudyResult"]


@dataclass(frozen=True, kw_only=True)
class StudyResult:
    """What a study found, once re-validation and the last control run are in."""

    records: list[TrialRecord]
    """Every measured trial of the study with its final figures and verdict
    (``search.revalidation.candidates.with_revalidation``)."""
    front: list[TrialRecord]
    """The final front (``search.revalidation.candidates.final_front``)."""
    best: TrialRecord | None
    """The recommendation (None: no front configuration meets the slo)."""
    unit: str
    """What throughput counts."""
    floor: NoiseFloor
    """The machine's noise floor at the end of the study."""
    revalidated: Mapping[int, Pooled]
    """The re-validated candidates' pooled figures, by trial number."""
    diagnoses: Mapping[int, Diagnosis]
    """Each complete trial's regime, by trial number (none without the device's peak)."""
