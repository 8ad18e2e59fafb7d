"""The few distribution functions the package needs, from ``scipy.special``.

``scipy.stats`` computes the same figures from the same special functions, but importing it takes
about 0.9 s of a 2-core CPU: every study process and every fresh worker paid it at start-up, for a
binomial tail, an F tail, a normal quantile and a straight-line fit. ``scipy.special`` takes a
fraction of that. ``tests/core/test_distributions.py`` holds each function to ``scipy.stats``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike
from scipy import special

__all__ = ["Line", "binom_ppf", "binom_sf_at_least", "f_sf", "line_fit", "norm_ppf"]


_TIE = 1e-12
"""A CDF this close below ``q`` (relative) reaches it: the difference is rounding."""


def binom_ppf(q: float, n: int, p: float) -> int:
    """The smallest k with P[Binomial(n, p) <= k] >= q, for 0 < q < 1 (``stats.binom.ppf``): the
    continuous inverse rounded up, then stepped to the smallest k that reaches ``q``. A CDF that
    meets ``q`` exactly (Binomial(59, 0.5) at 29 is 0.5) reads a rounding below it; within
    ``_TIE`` it counts as reaching it, as scipy's does."""

    def reaches(k: int) -> bool:
        return float(special.bdtr(k, n, p)) >= q * (1 - _TIE)

    k = min(max(math.ceil(float(special.bdtrik(q, n, p))), 0), n)
    while k > 0 and reaches(k - 1):
        k -= 1
    while k < n and not reaches(k):
        k += 1
    return k


def binom_sf_at_least(k: int, n: int, p: float) -> float:
    """P[Binomial(n, p) >= k]: the p-value of the one-sided exact binomial test of ``k``
    successes in ``n`` (``stats.binomtest(k, n, p, "greater").pvalue``)."""
    return 1.0 if k <= 0 else float(special.bdtrc(k - 1, n, p))


def f_sf(x: float, dfn: float, dfd: float) -> float:
    """P[F(dfn, dfd) > x] (``stats.f.sf``)."""
    return float(special.fdtrc(dfn, dfd, x))


def norm_ppf(q: float) -> float:
    """The standard normal's ``q`` quantile (``stats.norm.ppf``)."""
    return float(special.ndtri(q))


class Line(NamedTuple):
    """A least-squares straight line: its slope, the slope's standard error, and the two-sided
    p-value of the slope against 0 (t with n - 2 degrees of freedom)."""

    slope: float
    stderr: float
    pvalue: float


def line_fit(x: ArrayLike, y: ArrayLike) -> Line:
    """``y`` against ``x`` by least squares, for 3 or more points with ``x`` not all equal
    (``stats.linregress``'s slope, stderr and pvalue)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = len(xs)
    dx, dy = xs - xs.mean(), ys - ys.mean()
    sxx = float(dx @ dx)
    slope = float(dx @ dy) / sxx
    residual = float(((dy - slope * dx) ** 2).sum())
    stderr = math.sqrt(residual / (n - 2) / sxx)
    if stderr == 0:
        return Line(slope, 0.0, 0.0 if slope else 1.0)  # an exact line: sure of its slope
    t = slope / stderr
    return Line(slope, stderr, float(2 * special.stdtr(n - 2, -abs(t))))
