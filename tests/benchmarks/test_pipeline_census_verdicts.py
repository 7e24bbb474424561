# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The A/B's verdict per arm against the release, from the memory it sampled on cards, and the duration it announces
before it starts (the served census is ``test_pipeline_census_minimax_h3.py``'s)."""

from __future__ import annotations

import pytest

from benchmarks import pipeline_census as census_bench

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]


def _card_rows(growth_per_request: list[float], peak: float = 9000.0, retries: int = 0) -> list[dict]:
    after = [1000.0]
    for grown in growth_per_request:
        after.append(after[-1] + grown)
    return [
        {
            "rank": rank,
            "metric": "non_pytorch_bytes",
            "after_request_MiB": after,
            "growth_MiB": growth_per_request,
            "peak_reserved_MiB": [peak] * len(after),
            "alloc_retries": [retries] * len(after),
        }
        for rank in range(4)
    ]


def _summary(growth: dict[str, list[dict]], requests: int = 3) -> dict:
    return {"config": {"requests": requests}, "memory_growth": growth}


def test_an_arm_is_judged_by_its_growth_from_request_2_on_against_the_releases_with_its_peak_and_retries():
    summary = _summary(
        {
            "whole": _card_rows([300.0, 0.0]),  # request 1 grows once: judged from request 2 on
            "pool": _card_rows([50.0, 400.0], peak=15000.0, retries=2),
            "vae": _card_rows([6000.0, 6000.0]),
            "release": _card_rows([6600.0, 6600.0]),
        }
    )
    assert census_bench.verdicts(summary) == [
        "verdict per arm against the release (growth outside PyTorch from request 2 on: 6600.0 MiB)",
        "  whole: stops the growth: 0.0 MiB from request 2 on, peak reserved 9000 MiB, retries 0",
        "  pool: reduces the growth, with allocator retries: 400.0 MiB from request 2 on, peak reserved 15000 MiB, "
        "retries 2",
        "  vae: reduces the growth: 6000.0 MiB from request 2 on, peak reserved 9000 MiB, retries 0",
    ]


def test_on_cpu_ranks_or_without_enough_requests_no_verdict_on_device_memory_is_given():
    cpu = [{"rank": 0, "metric": "rss_bytes", "after_request_MiB": [1.0, 2.0, 3.0], "growth_MiB": [1.0, 1.0]}]
    lines = census_bench.verdicts(_summary({"whole": cpu, "release": cpu}))
    assert lines[1] == "  whole: no verdict: CPU ranks report the process RSS, not device memory"
    short = census_bench.verdicts(_summary({"whole": _card_rows([1.0]), "release": _card_rows([1.0])}, requests=2))
    assert short == ["verdicts: none (they need the release arm and --requests 3 or more)"]


def test_the_announced_duration_counts_servers_in_turn_on_cards_and_two_at_a_time_on_cpu_ranks():
    on_cards = census_bench.duration_estimate(("whole", "vae", "pool", "release"), 3, side_by_side=False, real=True)
    per_arm = census_bench.CARD_STARTUP_S + 3 * census_bench.CARD_REQUEST_S
    assert on_cards.startswith(
        f"4 arms (whole, vae, pool, release), one at a time, 3 requests each: about {4 * per_arm / 60:.0f} minutes"
    )
    on_cpu = census_bench.duration_estimate(("whole", "vae", "pool"), 2, side_by_side=True, real=False)
    per_turn = census_bench.CPU_STARTUP_S + 2 * 2 * census_bench.CPU_REQUEST_S
    assert f"about {2 * per_turn / 60:.0f} minutes (measured on CPU ranks here)" in on_cpu
