# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The benchmark's statistics on synthetic samples whose answer is known: no timing is measured here."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.stats import describe, paired_difference, paired_ratio

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def _noisy(rng: random.Random, value: float) -> float:
    return value * rng.lognormvariate(0, 0.05)


def test_the_interval_contains_a_known_ratio_under_noise():
    rng = random.Random(1)
    base = [rng.uniform(10, 20) for _ in range(60)]
    slower = [_noisy(rng, 1.25 * b) for b in base]
    faster = [_noisy(rng, b) for b in base]
    ratio = paired_ratio(slower, faster)
    assert ratio.low < 1.25 < ratio.high and ratio.low < ratio.value < ratio.high
    assert ratio.high - ratio.low < 0.1 and ratio.pairs == 60


def test_a_slowdown_shared_by_both_sides_of_each_pair_cancels():
    rng = random.Random(2)
    shared = [rng.choice([1.0, 3.0, 10.0]) for _ in range(40)]  # a scheduler that stalls some pairs tenfold
    first, second = [1.1 * s for s in shared], [1.0 * s for s in shared]
    ratio = paired_ratio(first, second)
    assert ratio.value == pytest.approx(1.1) and ratio.low == pytest.approx(1.1) and ratio.high == pytest.approx(1.1)
    # Shuffled out of their pairs, the same samples give an interval too wide to tell 1.1 from 1.0.
    shuffled = second[:]
    random.Random(3).shuffle(shuffled)
    unpaired = paired_ratio(first, shuffled)
    assert unpaired.low < 1.0 < 1.1 < unpaired.high


def test_a_ratio_with_no_effect_has_an_interval_around_one():
    rng = random.Random(4)
    base = [rng.uniform(5, 50) for _ in range(50)]
    ratio = paired_ratio([_noisy(rng, b) for b in base], [_noisy(rng, b) for b in base])
    assert ratio.low < 1.0 < ratio.high


def test_the_mean_difference_and_its_interval_follow_the_pairs():
    rng = random.Random(5)
    base = [rng.uniform(100, 200) for _ in range(50)]
    difference = paired_difference([b + 7 + rng.gauss(0, 1) for b in base], base)
    assert difference.low < 7 < difference.high and difference.high - difference.low < 1.5
    assert difference.value == pytest.approx(statistics.mean([7.0] * 50), abs=0.5)


@pytest.mark.parametrize(
    "first,second,pattern",
    [
        ([1.0, 2.0], [1.0], r"paired samples of 2 and 1 values"),
        ([1.0], [1.0], r"paired samples of 1 and 1 values; expected two equal lengths >= 2"),
        ([1.0, 0.0], [1.0, 1.0], r"non-positive timings \[0.0\]"),
    ],
)
def test_bad_samples_are_named(first, second, pattern):
    with pytest.raises(ValueError, match=pattern):
        paired_ratio(first, second)


def test_describe_prints_the_value_the_interval_and_the_pairs():
    ratio = paired_ratio([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert describe(ratio) == "2.000x [2.000, 2.000] (95% interval, 3 pairs)"
