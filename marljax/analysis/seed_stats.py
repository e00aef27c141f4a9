"""Intervals over training seeds, as `report` and `compare` print them.

A condition's value is the mean over its seeds with a t-based 95% confidence interval (df = seeds − 1): with 2
seeds t = 12.7, so two seeds that happen to agree do not make a narrow interval. A difference between two
conditions that ran the same seeds is paired by seed (the seeds share data: the same problem order and the
same eval problems), else it is Welch's. A difference is "resolved" only when its interval excludes 0.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """`mean` ± `half` (the half-width of the 95% interval; nan with one seed) over `n` seeds."""

    mean: float
    half: float
    n: int
    paired: bool = False

    @property
    def resolved(self) -> bool:
        """Whether the interval excludes 0."""
        return math.isfinite(self.half) and abs(self.mean) > self.half

    def fmt(self, spec: str = ".3f") -> str:
        """`0.250 [+0.101, +0.399]` (the mean, then the interval's ends); one seed: `0.250 (1 seed)`."""
        m = format(self.mean, spec)
        if not math.isfinite(self.half):
            return f"{m} ({self.n} seed{'s' if self.n != 1 else ''})"
        return f"{m} [{format(self.mean - self.half, '+' + spec)}, {format(self.mean + self.half, '+' + spec)}]"


def t_interval(values: Sequence[float]) -> Interval:
    """The mean of `values` with its t-based 95% interval (df = n − 1)."""
    a = np.asarray(values, dtype=np.float64)
    if len(a) == 0:
        raise ValueError("t_interval of no values")
    if len(a) < 2:
        return Interval(float(a.mean()), float("nan"), len(a))
    se = float(np.std(a, ddof=1) / math.sqrt(len(a)))
    return Interval(float(a.mean()), se * float(stats.t.ppf(0.5 + LEVEL / 2, len(a) - 1)), len(a))


def difference(a: Mapping[int, float], b: Mapping[int, float]) -> Interval:
    """a − b over seeds (seed → value): paired by seed when both ran the same seeds (df = n − 1), else
    Welch's interval (Welch–Satterthwaite df; nan with one seed on either side)."""
    if set(a) == set(b):
        return dataclasses.replace(t_interval([a[s] - b[s] for s in sorted(a)]), paired=True)
    x, y = np.asarray(list(a.values()), np.float64), np.asarray(list(b.values()), np.float64)
    mean = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return Interval(mean, float("nan"), min(len(x), len(y)))
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return Interval(mean, 0.0, min(len(x), len(y)))
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    return Interval(mean, se * float(stats.t.ppf(0.5 + LEVEL / 2, df)), min(len(x), len(y)))
