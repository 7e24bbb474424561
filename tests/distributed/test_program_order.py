# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Compiled collectives reach the backend in program order on every rank, on three and four gloo ranks: one function
compiled whole with Inductor in inference mode, its all-to-all split sizes different on every rank (so the ranks'
graphs differ), its collectives independent of one another. Plain ``torch.distributed`` cannot trace it whole, so
the oracle for the order is the program; for the bits, plain's eager call."""

from __future__ import annotations

import pytest

from tests.distributed import order_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module", params=[3, 4], ids=lambda world: f"{world}ranks")
def reports(request):
    world = request.param
    return results_or_raise(run_ranks(order_ranks.checks, world, timeout_s=600, pg_timeout_s=60), world)


def test_compiled_every_rank_hands_the_backend_its_collectives_in_program_order(reports):
    for rank, report in enumerate(reports):
        assert report["plain"][1] == order_ranks.PROGRAM_ORDER, rank  # the recorder sees the program's calls
        assert report["eager0"][1] == report["eager1"][1] == order_ranks.PROGRAM_ORDER, rank
        assert report["compiled"][1] == order_ranks.PROGRAM_ORDER, rank


def test_compiled_and_eager_give_plains_bits(reports):
    for rank, report in enumerate(reports):
        assert report["compiled"][0] == report["eager0"][0] == report["eager1"][0] == report["plain"][0], rank


def test_the_ops_that_keep_the_order_add_no_graph_break(reports):
    assert all(report["breaks"] == 0 for report in reports)
