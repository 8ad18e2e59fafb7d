"""The figures stored with one trial: its ``TrialResult`` flattened into plain numbers, units in
their names (Optuna user attrs, MLflow metrics, the CSV; see ``search.core.metrics`` for what each
objective is ranked on). Above the runner, so that the metric registry below needs nothing of how
a trial runs."""

from __future__ import annotations

from search.analysis.run_figures import micro_batch_metrics, stall_steps
from search.core.metrics import latency_quantiles
from search.core.records import COMPLETE, SCREENED, with_requests
from search.execution.phases import phase_metrics
from search.execution.trial import TrialResult

__all__ = ["trial_metrics"]


def trial_metrics(result: TrialResult, confidence: float) -> dict[str, float]:
    """The figures stored with one trial, units in their names; only fidelity errors unless
    complete."""
    m = result.measurement
    if m is None or result.state != COMPLETE:
        return dict(result.fidelity)
    metrics = {
        "throughput": m.throughput,
        "throughput_ci_low": m.throughput_ci_low,
        "throughput_ci_high": m.throughput_ci_high,
        # The run's own interval; throughput_ci_low/high are widened to span runs
        # (``search.analysis.noise_floor``) when a noise floor is known.
        "throughput_within_ci_low": m.throughput_ci_low,
        "throughput_within_ci_high": m.throughput_ci_high,
        "throughput_cv": m.throughput_cv,
        "throughput_median": m.throughput_median,
        **latency_quantiles({"steps": m.step_latencies_ms, **m.phase_samples_ms}, confidence),
        "latency_mean_ms": m.latency_mean_ms,
        "n_windows": m.n_windows,
        "n_steps": m.n_steps,
        "steps_per_window": m.steps_per_window,
        "outliers_mild": m.outliers_mild,
        "outliers_severe": m.outliers_severe,
        "stall_steps": stall_steps(m.step_latencies_ms),
        **micro_batch_metrics(m.phase_samples_ms),
        "measure_time_s": m.elapsed_s,
        # 1: racing stopped it early, out of reach of the front (``search.analysis.racing``)
        "screened": float(m.stop_reason == SCREENED),
        "trial_time_s": result.duration_s,
        # where the worker's time went (build, compile, fidelity check, warm-up, windows, ...)
        **phase_metrics(result.phases_s),
    }
    if result.items_per_request is not None:
        # requests/s is throughput in other units: the same interval and CV, scaled
        metrics["items_per_request"] = result.items_per_request
        metrics["requests_per_s_cv"] = m.throughput_cv
    if result.peak_memory_mb is not None:
        metrics["peak_memory_mb"] = result.peak_memory_mb
    figures = {
        **result.work,
        **result.telemetry,
        **result.fidelity,
        **result.compile,
        **result.held,
    }
    return with_requests({**metrics, **figures})
