"""The 97.5% quantile of Student's t, computed: the regularized incomplete beta function by its continued
fraction gives the CDF, bisection inverts it (exact past 30 degrees of freedom, where printed tables stop)."""

from __future__ import annotations

import math


def _regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below the mean: use the symmetry
        return 1.0 - _regularized_beta(1.0 - x, b, a)
    log_front = (
        a * math.log(x) + b * math.log1p(-x) - math.log(a) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    )
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction


def _t_two_sided_mass(q: float, dof: int) -> float:
    """P(|T| <= q) for Student's t with ``dof`` degrees of freedom."""
    return 1.0 - _regularized_beta(dof / (dof + q * q), dof / 2, 0.5)


def t_quantile_975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom (>= 1), computed (bisection on the CDF)."""
    if dof < 1:
        raise ValueError(f"dof={dof} is out of range: a t interval needs at least 2 values (dof >= 1)")
    low, high = 0.0, 1.0
    while _t_two_sided_mass(high, dof) < 0.95:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_two_sided_mass(mid, dof) < 0.95 else (low, mid)
        if high - low < 1e-12:
            break
    return (low + high) / 2
