"""What compiling cost and bought: compile time, break-even and variance, one line each.

The compiled configuration reported is the recommendation where it is compiled, else the fastest
stable compiled one; of those, the first whose twin, the same configuration uncompiled, the study
measured too, so that they can be compared:

- **compile time**: its own (cold: the compiler's cache had none of its graphs; warm: all came
  from the cache of an earlier process), and the median of every compiled trial, cold and warm
  (each compiled trial's second process is a warm one);
- **break-even**: the speed-up over the twin, and the steps after which the compile time is paid
  back: ``compile_time_s / (twin's step time - its step time)``;
- **variance**: the spread of its throughput between fresh processes (re-validation, else its
  trial's two) against the twin's and the machine's (the noise floor), and its stability verdict
  against the control.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import numpy as np

from search.analysis.noise_floor import NoiseFloor
from search.core.records import COMPLETE, TrialRecord, config_name
from search.revalidation.candidates import is_compiled, uncompiled_twin
from search.revalidation.pooling import Pooled

__all__ = ["compile_lines"]


def compile_lines(
    final: Sequence[TrialRecord],
    best: TrialRecord | None,
    done: Mapping[int, Pooled],
    floor: NoiseFloor,
) -> list[str]:
    """The three lines about compilation; none where no compiled configuration completed."""
    compiled = [r for r in final if r.state == COMPLETE and is_compiled(r)]
    if not compiled:
        return []
    # The recommendation first, then the stable ones fastest first; the first of them whose
    # uncompiled twin was measured, so that the break-even can be given.
    ranked = sorted(
        [r for r in compiled if r.stable] or compiled,
        key=lambda r: -r.metrics.get("throughput", 0.0),
    )
    candidates = ([best] if best is not None and is_compiled(best) else []) + ranked
    paired = ((r, uncompiled_twin(r, final)) for r in candidates)
    shown, twin = next(((r, t) for r, t in paired if t is not None), (candidates[0], None))
    return [
        _time_line(shown, compiled),
        _break_even_line(shown, twin),
        _variance_line(shown, twin, done, floor),
    ]


def _time_line(shown: TrialRecord, compiled: Sequence[TrialRecord]) -> str:
    m = shown.metrics
    cold = [r.metrics["compile_time_s"] for r in compiled if not r.metrics["compile_cache_warm"]]
    warm = [r.metrics["compile_time_s"] for r in compiled if r.metrics["compile_cache_warm"]]
    # every compiled trial's second process starts from the cache its first one filled
    warm += [
        r.metrics["compile_time_warm_s"] for r in compiled if "compile_time_warm_s" in r.metrics
    ]
    spread = ", ".join(
        f"{len(times)} {kind} (median {statistics.median(times):.1f} s)"
        for kind, times in (("cold", cold), ("warm", warm))
        if times
    )
    return (
        f"compile time: #{shown.number} {config_name(shown.config)} compiled in "
        f"{m['compile_time_s']:.1f} s ({'warm' if m['compile_cache_warm'] else 'cold'} cache; "
        f"{m['compile_graphs']:.0f} graph(s), {m['compile_graph_breaks']:.0f} graph break(s), "
        f"{m['compile_recompiles']:.0f} recompile(s)); compiled trials: {spread}"
    )


def _break_even_line(shown: TrialRecord, twin: TrialRecord | None) -> str:
    if twin is None:
        return (
            "break-even: unknown, no compiled configuration was measured uncompiled too "
            "(compile=off among the choices lets the search measure both)"
        )
    speedup = shown.metrics["throughput"] / twin.metrics["throughput"]
    step_s, twin_step_s = (r.metrics["latency_mean_ms"] / 1e3 for r in (shown, twin))
    head = f"break-even: {speedup:.2f}x the throughput of #{twin.number} (the same uncompiled)"
    if step_s >= twin_step_s:
        return f"{head}; not faster per step, so its compile time is never paid back"
    steps = shown.metrics["compile_time_s"] / (twin_step_s - step_s)
    return (
        f"{head}; its {shown.metrics['compile_time_s']:.1f} s compile time is paid back after "
        f"{steps:,.0f} steps ({steps * step_s:,.0f} s of running it)"
    )


def _variance_line(
    shown: TrialRecord, twin: TrialRecord | None, done: Mapping[int, Pooled], floor: NoiseFloor
) -> str:
    between_cv = f"{floor.between_cv:.1%}" if floor.between_df else "unknown"
    machine = f"the machine's {between_cv}"
    parts = [f"{_between(shown, done)} compiled"]
    if twin is not None:
        parts.append(f"{_between(twin, done)} uncompiled")
    verdict = "stable" if shown.stable else f"unstable ({shown.reason})"
    return (
        f"variance between fresh processes: {', '.join(parts)}, {machine}; "
        f"#{shown.number} is {verdict}"
    )


def _between(record: TrialRecord, done: Mapping[int, Pooled]) -> str:
    """The CV of ``record``'s throughput between its fresh processes, with their count: those of
    re-validation, else a compiled trial's own two."""
    pooled = done.get(record.number)
    runs = pooled.runs if pooled is not None else ()
    if len(runs) < 2 and "compile_between_process_cv" in record.metrics:
        cv = record.metrics["compile_between_process_cv"]
        return f"CV {cv:.1%} over 2 processes (#{record.number}, its trial)"
    if len(runs) < 2:
        return f"not re-validated (#{record.number})"
    throughputs = np.array([run.throughput for run in runs])
    cv = float(np.std(throughputs, ddof=1) / np.mean(throughputs))
    return f"CV {cv:.1%} over {len(runs)} processes (#{record.number})"
