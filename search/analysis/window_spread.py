"""How far the window CV of one kind of run moves from run to run, beyond what its windows'
sampling explains: the scale by which the window-dispersion test (``search.stability.judge``)
shrinks its degrees of freedom.

Why: the dispersion test compares a run's window variance with the control's by an F-test, which
holds where every run's windows are independent draws from one normal distribution. Here they are
not. On the 2-core AMD EPYC the compute probe's window CV ranged from 0.4% to 27% over the 56
control runs of one idle record (``benchmarks/data/coverage_by_kind-2026-11-27-idle.json``, 5
windows each), where from 5 normal windows two runs' CVs differ by more than 3x in only 5% of
pairs.
Its windows are heavy-tailed: a run that catches a slow second has a large CV, one beside it none.
Judged by the F-test alone, a steady configuration that computes was called unstable in 4 of 24
runs at alpha 1%.

The remedy is quasi-likelihood's: ``log(cv²)`` of a run with ``k`` window degrees of freedom has
variance ``ψ'(k/2)`` (trigamma) when its windows are normal; where the control runs' ``log(cv²)``
vary by more, every variance ratio is as uncertain as if the runs had had that many times fewer
windows, and the F-test's degrees of freedom are scaled down by that ratio. Control runs as alike
as normal windows make them leave the test as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import special

from search.analysis.run_figures import RunFigures

__all__ = ["MIN_SCALE_RUNS", "window_df_scale"]

MIN_SCALE_RUNS = 3
"""Control runs (of the class a run is judged against) the scale needs: from fewer, the variance
of their ``log(cv²)`` rests on one degree of freedom, and the test stays a plain F-test."""


def window_df_scale(runs: Sequence[RunFigures]) -> float:
    """The factor in (0, 1] by which the window degrees of freedom of runs like ``runs`` count:
    what normal windows would make the variance of their ``log(cv²)``, over what it is (each
    ``log(cv²)`` less its expectation's bias at its degrees of freedom, so that runs of unequal
    length compare); 1 where they vary no more than that, or from fewer than ``MIN_SCALE_RUNS``."""
    usable = [r for r in runs if r.n_windows > 1 and r.cv > 0]
    if len(usable) < MIN_SCALE_RUNS:
        return 1.0
    half_df = np.array([r.n_windows - 1 for r in usable], dtype=float) / 2
    # E[log(chi²_k / k)] = ψ(k/2) - log(k/2), Var = ψ'(k/2)
    log_var = 2 * np.log([r.cv for r in usable]) - (special.digamma(half_df) - np.log(half_df))
    observed = float(np.var(log_var, ddof=1))
    sampling = float(np.mean(special.polygamma(1, half_df)))
    return min(1.0, sampling / observed) if observed > 0 else 1.0
