"""Student's t distribution's quantiles, exactly, for the calibration's safe bound."""

from __future__ import annotations

import math
from functools import lru_cache

# Student's t quantiles are found by bisection on the exact CDF to this width.
T_QUANTILE_TOLERANCE = 1e-10


def _student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with an integer `df` >= 1, exactly (Abramowitz & Stegun,
    "Handbook of Mathematical Functions", 26.7.3 and 26.7.4: finite series in cos(theta),
    theta = atan(t / sqrt(df)), for P(|T| <= t))."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:
        term = series = math.cos(theta)
        for power in range(3, df - 1, 2):  # cos^3 ... cos^(df - 2): 2/3, 2*4/(3*5), ...
            term *= cos2 * (power - 1) / power
            series += term
        within = 2 / math.pi * (theta + (math.sin(theta) * series if df > 1 else 0.0))
    else:
        term = series = 1.0
        for power in range(2, df - 1, 2):  # cos^2 ... cos^(df - 2): 1/2, 1*3/(2*4), ...
            term *= cos2 * (power - 1) / power
            series += term
        within = math.sin(theta) * series
    return (1 + within) / 2


@lru_cache(maxsize=1024)
def student_t_quantile(p: float, df: int) -> float:
    """The `p`-quantile (0.5 <= p < 1) of Student's t with `df` degrees of freedom, rounded up
    by at most T_QUANTILE_TOLERANCE."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    low, high = 0.0, 1.0
    while _student_t_cdf(high, df) < p:
        low, high = high, 2 * high
    while high - low > T_QUANTILE_TOLERANCE:
        middle = (low + high) / 2
        if _student_t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
    return high
