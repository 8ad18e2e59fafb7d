"""Shared by the tests: functions that build the objects a test needs whole but cares about only
in part (a measurement with given figures, a machine's noise floor, the llm space's settings on a
CPU). The overrides that make a study tiny are in ``tiny_overrides.py``."""

from search.analysis.noise_floor import NoiseFloor, RunFigures
from search.config.compose import compose_config, load_settings
from search.config.settings import Settings
from search.measurement.protocol import Measurement
from search.measurement.statistics import Summary


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


def llm_settings() -> Settings:
    """The typed settings of the built-in llm space on a CPU, as the command composes them."""
    return load_settings(compose_config(["+space=llm", "device=cpu"]))


def cpu_context(tmp_path, space, text, peaks=()):
    """An invocation of the llm space's settings on this CPU (named "a cpu") over ``space``, with
    ``runs_dir`` under ``tmp_path``, printing to ``text`` (a StringIO)."""
    from dataclasses import replace

    import torch
    from rich.console import Console

    from search.commands.context import Context

    return Context(
        settings=replace(llm_settings(), runs_dir=str(tmp_path)),
        space=space,
        device=torch.device("cpu"),
        env={"device_name": "a cpu"},
        fingerprint="f",
        out=Console(file=text, width=1000),
        control=None,
        peaks=list(peaks),
    )
