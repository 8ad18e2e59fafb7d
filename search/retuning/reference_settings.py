"""The reference step's settings: the fixed workload, configuration and measurement that tell the
machine's speed.

The reference step (``search.workloads.reference``) is a fixed tiny training step of the built-in
GPT with a fixed matrix product: it does not depend on the space's model, so a slower machine is
not blamed on the model.
"""

from __future__ import annotations

from typing import Any

from search.measurement.protocol import MeasureSettings

__all__ = ["REFERENCE_CONFIG", "REFERENCE_MEASURE", "REFERENCE_WORKLOAD", "reference_workload"]

REFERENCE_WORKLOAD = {
    "_target_": "search.workloads.reference.ReferenceStep",
    "vocab_size": 256,
    "seq_len": 32,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 2,
}
"""The reference step's model: fixed, whatever the space (its matrix size is fixed per device
type: ``reference_workload``)."""


def reference_workload(device: str) -> dict[str, Any]:
    """The reference step's workload on ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""
    from search.workloads.reference import MATMUL

    size, repeats = MATMUL[device.split(":")[0]]
    return {**REFERENCE_WORKLOAD, "matmul_size": size, "matmul_repeats": repeats}


REFERENCE_CONFIG = {"batch_size": 8, "micro_batch_size": 8, "precision": "fp32"}
REFERENCE_MEASURE = MeasureSettings(
    warmup_steps=2, warmup_s=0.3, window_s=0.1, min_windows=5, max_windows=10, max_time_s=2.0
)
"""Short: a run's mean varies from process to process by far more than its windows say (several
percent on a shared CPU), so a longer run would buy little."""
