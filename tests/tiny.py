"""Shared by the tests: overrides for a GPT small enough that a trial takes about a second on a
2-core CPU, the knobs and metrics the MLflow contract promises, and a measurement with given figures."""

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.measurement.protocol import Measurement
from search.measurement.statistics import Summary

TRIALS_ONLY = [
    "revalidate.processes=0",
    # no confirmation runs after the study (16 fresh runs): tests/retune/test_retune.py covers them
    "retune.confirm=0",
    # no control runs (3 fresh processes, about 9 s an invocation): test_llm_study_end_to_end in
    # tests/commands/test_e2e.py and tests/study/test_study.py measure the machine's noise
    "noise.budget=0",
]
"""No fresh processes but the trials': an invocation's other runs are the same for every study."""
TINY = [
    "device=cpu",
    "preset=cpu",
    "space.workload.vocab_size=256",
    "space.workload.seq_len=32",
    "space.workload.d_model=32",
    "space.workload.n_layers=1",
    "space.workload.n_heads=2",
    "space.params.batch_size.high=8",
    "space.params.micro_batch_size.high=8",
    # Eager: a test not about the compiler must not pay a cold compile (20-30 s a trial on two
    # cores, every test with a cache of its own); the compiler's tests search it themselves.
    "space.params.compile.choices=[off]",
    "measure.warmup_s=0.1",
    "measure.window_s=0.05",
    "measure.min_windows=3",
    "measure.max_time_s=1",
    *TRIALS_ONLY,
]
LENIENT = [
    "stable.excess_cv=10",
    "stable.excess_stalls=1",
    "stable.excess_between_cv=10",
]
"""Stability margins no tiny configuration can exceed: every complete trial is stable."""
TINY_GPT = {
    "_target_": "search.workloads.GPT",
    "vocab_size": 64,
    "seq_len": 16,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 2,
}
"""A workload mapping for tests that build a trial request themselves (a step of a few ms)."""
KNOBS = {
    "batch_size",
    "micro_batch_size",
    "precision",
    "streams",
    "recompute",
    "compile",
    "optimizer",
}
"""The llm space's knobs: the params every trial's MLflow run logs."""
CONTRACT_METRICS = {
    "throughput",
    "throughput_ci_low",
    "throughput_ci_high",
    "throughput_cv",
    "latency_p50_ms",
    "latency_p95_ms",
    "peak_memory_mb",
}


def measurement(
    throughput: float, cv: float = 0.01, latencies=(10.0, 11.0, 12.0), phases=None
) -> Measurement:
    """A measurement with the throughput, CV, step latencies and times inside steps given; the rest
    does not matter."""
    return Measurement(
        summary=Summary(
            throughput=throughput,
            throughput_ci_low=throughput,
            throughput_ci_high=throughput,
            throughput_cv=cv,
            throughput_median=throughput,
            latency_p50_ms=0.0,
            latency_p95_ms=0.0,
            latency_mean_ms=0.0,
            outliers_mild=0,
            outliers_severe=0,
        ),
        steps_per_window=1,
        warmup_steps=1,
        warmup_s=0.0,
        elapsed_s=0.0,
        stop_reason="max_windows",
        window_throughputs=(throughput,) * 5,
        step_latencies_ms=tuple(latencies),
        phase_samples_ms=dict(phases or {}),
    )


def noise_floor(between_cv: float) -> NoiseFloor:
    """A machine whose fresh runs spread by ``between_cv`` (20 df), from 3 steady control runs."""
    controls = tuple(
        RunFigures(time_s=float(t), throughput=100.0, cv=0.01, n_windows=5, n_steps=5, stalls=0)
        for t in range(3)
    )
    return NoiseFloor(
        controls=controls,
        between_cv=between_cv,
        between_df=20,
        drift=0.0,
        drift_p=1.0,
        corrected=False,
    )
