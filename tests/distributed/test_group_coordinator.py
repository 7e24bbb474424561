# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""vLLM-Omni's diffusion ``GroupCoordinator`` through the platform's collectives, on gloo ranks: eager, and compiled
where each collective runs eagerly behind a graph break or through an op, as the series stands."""

from __future__ import annotations

import pytest

from tests.distributed import coordinator_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def eager():
    return results_or_raise(run_ranks(coordinator_ranks.eager_checks, 4, timeout_s=600), 4)


def test_every_collective_of_the_coordinator_gives_the_plain_bits_with_persistent_buffers(eager):
    for report in eager:
        assert all(report["equal"].values()), report["equal"]
        assert report["dim1_is_concatenation"] and report["in_place"] and report["separate_dim1_is_each_ranks"]


def test_with_persistent_buffers_the_coordinator_hands_the_backend_only_blocks(eager):
    assert all(report["unmanaged"] == 0 for report in eager)


def test_a_collective_on_the_coordinators_gloo_group_is_control_and_keeps_no_block(eager):
    assert all(report["control"] for report in eager)


def test_bad_arguments_raise_on_every_rank_before_any_collective_naming_the_value(eager):
    for report in eager:
        assert report["errors"] == {
            "dim": "dim=1 for a tensor of shape (5,): expected a dim of it",
            "src": "src=4: expected a rank of this group, src < 4",
        }


@pytest.fixture(scope="module")
def graphs():
    return results_or_raise(run_ranks(coordinator_ranks.graph_checks, 2, timeout_s=600), 2)


def test_compiled_with_staging_off_the_graph_holds_torchs_functional_collectives_and_none_of_ours(graphs):
    for report in graphs:
        assert report["0"] == [
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.all_reduce",
            "_c10d_functional.wait_tensor",
        ]


def test_compiled_with_staging_on_every_collective_reaches_the_backend_through_blocks_with_the_plain_bits(graphs):
    for report in graphs:
        assert not any(op.startswith("_c10d_functional.") for op in report["1"]), report["1"]
        assert report["request1"]["calls"] > 0 and report["request1"]["unmanaged"] == 0
        assert report["bits1"] == report["bits0"]
