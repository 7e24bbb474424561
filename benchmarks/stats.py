# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Ratios and differences of paired timings, with a bootstrap interval, for a machine where noise is large.

Four ranks on two cores: the scheduler moves every timing by more than the effect under study, and by
the same factor for both strategies of one pair (they run back to back, in rotating order). Per-pair
log ratios cancel such a shared slowdown; the interval comes from resampling the pairs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

CONFIDENCE = 0.95
RESAMPLES = 4000


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float
    high: float
    pairs: int
    confidence: float = CONFIDENCE

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _pairs(numerator: Sequence[float], denominator: Sequence[float]) -> None:
    if len(numerator) != len(denominator) or len(numerator) < 2:
        raise ValueError(
            f"paired samples of {len(numerator)} and {len(denominator)} values; expected two equal lengths >= 2"
        )


def _bootstrap(values: list[float], statistic: Callable[[list[float]], float], seed: int) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over ``RESAMPLES`` resamples of ``values`` (the pairs)."""
    rng = random.Random(seed)
    stats = sorted(statistic(rng.choices(values, k=len(values))) for _ in range(RESAMPLES))
    tail = (1 - CONFIDENCE) / 2
    return stats[int(tail * (RESAMPLES - 1))], stats[math.ceil((1 - tail) * (RESAMPLES - 1))]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float], *, seed: int = 0) -> Estimate:
    """Geometric mean of ``numerator[i] / denominator[i]``: a factor common to both sides of a pair cancels."""
    _pairs(numerator, denominator)
    if bad := [v for v in (*numerator, *denominator) if not v > 0]:
        raise ValueError(f"paired ratio of non-positive timings {bad[:3]}; expected seconds > 0")
    logs = [math.log(a / b) for a, b in zip(numerator, denominator, strict=True)]
    low, high = _bootstrap(logs, _mean, seed)
    return Estimate(math.exp(_mean(logs)), math.exp(low), math.exp(high), len(logs))


def paired_difference(first: Sequence[float], second: Sequence[float], *, seed: int = 0) -> Estimate:
    """Mean of ``first[i] - second[i]``, in the samples' unit."""
    _pairs(first, second)
    differences = [a - b for a, b in zip(first, second, strict=True)]
    low, high = _bootstrap(differences, _mean, seed)
    return Estimate(_mean(differences), low, high, len(differences))


def describe(estimate: Estimate, unit: str = "x", digits: int = 3) -> str:
    return (
        f"{estimate.value:.{digits}f}{unit} [{estimate.low:.{digits}f}, {estimate.high:.{digits}f}] "
        f"({estimate.confidence:.0%} interval, {estimate.pairs} pairs)"
    )
