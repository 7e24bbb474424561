# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Inductor on gloo ranks, once, on the whole series (this checkout's own: each patch's tests compile with
``aot_eager``, which runs the registered ops as they are). As vLLM-Omni compiles the DiT on XPU: whole-graph,
dynamic shapes, inference mode. Inductor fuses the code around the registered ops otherwise than around torch's
functional collectives, so staged results are compared to staging off within ``close_floats``.

Program order: one function calling every kind ``managed_distributed`` traces, its collectives independent of one
another, compiled whole on three and four ranks with all-to-all split sizes different on every rank (so the ranks'
graphs differ). Plain ``torch.distributed`` cannot trace it whole, so the oracle for the order is the program; for
the bits, plain's eager call.

One start of ranks per world size (``inductor_ranks``): each start pays the imports and Inductor's first compile."""

from __future__ import annotations

import pytest

from tests.distributed import inductor_ranks, order_ranks
from tests.distributed.collective_ranks import close_floats
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def two_ranks():
    return results_or_raise(run_ranks(inductor_ranks.two_rank_checks, 2, timeout_s=900), 2)


@pytest.fixture(scope="module")
def four_ranks():
    return results_or_raise(run_ranks(inductor_ranks.four_rank_checks, 4, timeout_s=900), 4)


@pytest.fixture(scope="module", params=[3, 4], ids=lambda world: f"{world}ranks")
def order(request):
    if request.param == 4:
        return [report["order"] for report in request.getfixturevalue("four_ranks")]
    return results_or_raise(run_ranks(order_ranks.checks, 3, timeout_s=600, pg_timeout_s=60), 3)


def test_the_compiled_coordinator_is_one_graph_staged_through_blocks_with_the_results_of_staging_off(two_ranks):
    for report in two_ranks:
        result = report["coordinator"]["inductor"]
        assert result["graph_breaks"] == 0 and result["close"]
        assert result["staged_calls"] > 0 and result["staged_unmanaged"] == 0


def test_every_kind_through_managed_distributed_is_one_graph_staged_through_blocks_with_the_results_of_off(
    four_ranks,
):
    for report in (report["managed"] for report in four_ranks):
        assert report["inductor_breaks1"] == 0
        assert close_floats(report["inductor1"][0], report["aot_eager0"][0])
        assert report["inductor1"][1]["calls"] > 0 and report["inductor1"][1]["unmanaged"] == 0


@pytest.mark.parametrize("pattern", ["ulysses", "ring"])
def test_sequence_parallel_compiled_staged_through_blocks_with_the_results_of_off_and_the_same_graph_breaks(
    two_ranks, pattern
):
    for report in two_ranks:
        case = report["sequence_parallel"][f"{pattern}/inductor"]
        off, on = case["graph_breaks"]
        assert case["close"] and off == on and (off == 0 if pattern == "ulysses" else off > 0), case
        assert case["staged"][0] > 0 and case["staged"][1] == 0, case


def test_compiled_every_rank_hands_the_backend_its_collectives_in_program_order(order):
    for rank, report in enumerate(order):
        assert report["plain"][1] == order_ranks.PROGRAM_ORDER, rank  # the recorder sees the program's calls
        assert report["eager0"][1] == report["eager1"][1] == order_ranks.PROGRAM_ORDER, rank
        assert report["compiled"][1] == order_ranks.PROGRAM_ORDER, rank


def test_compiled_and_eager_give_plains_bits(order):
    for rank, report in enumerate(order):
        assert report["compiled"][0] == report["eager0"][0] == report["eager1"][0] == report["plain"][0], rank


def test_the_ops_that_keep_the_order_add_no_graph_break(order):
    assert all(report["breaks"] == 0 for report in order)
