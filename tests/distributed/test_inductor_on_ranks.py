# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Inductor on gloo ranks, once, on the whole series (this checkout's own: each patch's tests compile with
``aot_eager``, which runs the registered ops as they are). As vLLM-Omni compiles the DiT on XPU: whole-graph,
dynamic shapes, inference mode. Inductor fuses the code around the registered ops otherwise than around torch's
functional collectives, so staged results are compared to staging off within ``close_floats``."""

from __future__ import annotations

import pytest

from tests.distributed import inductor_ranks, sequence_parallel_ranks, traced_ranks
from tests.distributed.collective_ranks import close_floats
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

INDUCTOR = ("inductor",)


def test_the_compiled_coordinator_is_one_graph_staged_through_blocks_with_the_results_of_staging_off():
    reports = results_or_raise(run_ranks(traced_ranks.compile_checks, 2, INDUCTOR, timeout_s=900), 2)
    for report in reports:
        result = report["inductor"]
        assert result["graph_breaks"] == 0 and result["close"]
        assert result["staged_calls"] > 0 and result["staged_unmanaged"] == 0


def test_every_kind_through_managed_distributed_is_one_graph_staged_through_blocks_with_the_results_of_off():
    for report in results_or_raise(run_ranks(inductor_ranks.managed_checks, 4, timeout_s=900), 4):
        assert report["inductor_breaks1"] == 0
        assert close_floats(report["inductor1"][0], report["aot_eager0"][0])
        assert report["inductor1"][1]["calls"] > 0 and report["inductor1"][1]["unmanaged"] == 0


@pytest.fixture(scope="module")
def sequence_parallel():
    return results_or_raise(run_ranks(sequence_parallel_ranks.compile_checks, 2, INDUCTOR, timeout_s=900), 2)


@pytest.mark.parametrize("pattern", ["ulysses", "ring"])
def test_sequence_parallel_compiled_staged_through_blocks_with_the_results_of_off_and_the_same_graph_breaks(
    sequence_parallel, pattern
):
    for report in sequence_parallel:
        case = report[f"{pattern}/inductor"]
        off, on = case["graph_breaks"]
        assert case["close"] and off == on and (off == 0 if pattern == "ulysses" else off > 0), case
        assert case["staged"][0] > 0 and case["staged"][1] == 0, case
