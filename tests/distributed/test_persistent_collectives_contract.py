# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The layer keeps the plain collective's contract on four gloo ranks: every case run plain, then staged.

The ranks start once per module (``contract_ranks.checks``); each test asserts one property.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from tests.distributed import contract_ranks
from tests.distributed.layer_ranks import bits, data
from tests.utils import results_or_raise, run_ranks, use_working_tree

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 4
SAME_AS_PLAIN = (
    "outside_group_sync",
    "outside_group_async",
    "coalesced",
    "transposed_sum",
    "strided_with_gaps",
    "saved_for_backward",
    "flat_output_2d_input",
    "flat_output_0d_input",
    "stacked_output",
    "object_collectives",
    "dropped_works",
    "dropped_work_then_another_group",
    "gather_output_saved_for_backward",
    "bool_sum",
    "conjugated_complex",
    "p2p_as_a_tuple",
    "average_saved_for_backward",
    "average_of_integers",
    "barrier_after_async_work",
    "barrier_with_a_timeout_on_one_rank",
    "sends_and_receives_on_views_of_one_buffer",
    "two_groups_on_disjoint_views_in_either_order",
    "barrier_after_a_send",
    "wait_that_times_out_then_succeeds",
)


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(contract_ranks.checks, WORLD, timeout_s=600, pg_timeout_s=60), WORLD)


def _observed(report, case):
    return {k: v for k, v in report["staged"][case].items() if not k.startswith("_")}


@pytest.mark.parametrize("case", SAME_AS_PLAIN)
def test_staged_call_is_observed_exactly_as_the_plain_one_on_every_rank(reports, case):
    for rank, report in enumerate(reports):
        assert _observed(report, case) == report["plain"][case], (rank, case)


def test_object_collectives_are_staged_through_distributed_c10ds_own_names(reports):
    for report in reports:
        staged = report["staged"]["object_collectives"]
        assert staged["_staged"] == 4  # sizes and payload, for each of the two
        assert staged["_handed"] == ["all_gather_single", "broadcast"]  # list gathers run as one in place


def test_a_rank_outside_the_group_is_left_alone_and_its_peers_are_staged(reports):
    for rank, report in enumerate(reports):
        staged = report["staged"]["outside_group_sync"]["_staged"]
        assert staged == (3 if rank in (1, 2) else 0), rank
        assert report["plain"]["outside_group_async"]["work"] == ("a work" if rank in (1, 2) else "NoneType")


def test_calls_the_layer_cannot_stage_alike_go_to_the_plain_collective(reports):
    for report in reports:
        for case in (
            "coalesced",
            "strided_with_gaps",
            "flat_output_2d_input",
            "flat_output_0d_input",
            "stacked_output",
        ):
            assert report["staged"][case]["_staged"] == 0, case


def test_an_all_to_all_whose_output_is_its_input_goes_to_the_plain_collective(reports):
    # What the backend makes of the overlap is its own (gloo's result varies run to run): the layer keeps out.
    assert all(report["staged"]["all_to_all_in_place"]["_staged"] == 0 for report in reports)


def test_refused_shapes_raise_the_plain_error_on_every_rank(reports):
    for report in reports:
        for case in ("flat_output_2d_input", "flat_output_0d_input"):
            assert "raised" in report["plain"][case] and _observed(report, case) == report["plain"][case]


def test_a_transposed_sum_on_four_ranks_is_staged_in_its_own_element_order(reports):
    for report in reports:
        assert report["staged"]["transposed_sum"]["_staged"] == 1
        assert report["staged"]["transposed_sum"]["strides"] == [1, 96]


def test_no_autograd_version_bump_where_plain_makes_none(reports):
    for report in reports:
        assert report["plain"]["saved_for_backward"]["version_bump"] == 0
        assert report["staged"]["saved_for_backward"]["version_bump"] == 0
        assert report["staged"]["saved_for_backward"]["_staged"] == 1


def test_a_work_dropped_without_wait_delivers_its_result_and_frees_its_workspace_without_blocking(reports):
    for report in reports:
        dropped = report["staged"]["dropped_works"]
        # Ten in flight on one group: past its eight workspaces the plain collective runs, counted.
        assert dropped["landed"] and dropped["_staged"] + dropped["_fallbacks"] == 10 + 20
        assert dropped["_fallbacks"] <= 2
        assert "raised" not in report["staged"]["dropped_work_then_another_group"]  # no peer left waiting
        assert report["busy_after_all"] == 0


def test_gathers_bump_output_versions_as_plain_does_so_autograd_still_objects(reports):
    for report in reports:
        assert report["plain"]["gather_output_saved_for_backward"]["raised"] == "RuntimeError"
        assert report["staged"]["gather_output_saved_for_backward"]["raised"] == "RuntimeError"


def test_any_allocator_error_on_one_rank_runs_the_plain_collective_there(reports):
    for rank, report in enumerate(reports):
        outcome = report["allocator_error"]
        assert outcome["values"] == outcome["expected"], rank
        assert outcome["fallbacks"] == (3 if rank == 1 else 0), rank
        assert (("all_reduce", "memory") in outcome["warned"]) is (rank == 1), rank


def test_a_signature_less_wrapper_installed_first_still_reaches_the_backend(reports):
    for report in reports:
        assert report["recorder_calls"] > 0
        assert all(_observed(report, case) == report["plain"][case] for case in SAME_AS_PLAIN)


def test_a_referenced_work_does_not_keep_a_grown_workspaces_old_block(reports):
    for report in reports:
        assert report["lifetime"] == {"old_block_freed": True, "resident_is_live": True, "kept": True}


def test_pools_die_with_their_group(reports):
    for report in reports:
        assert report["pools"]["after"] == report["pools"]["before"]


def test_a_barrier_is_an_all_reduce_of_a_workspace_that_holds_every_rank_until_the_last(reports):
    last_arrival = max(report["barrier"]["arrived"] for report in reports)  # rank 0 sleeps a second first
    for rank, report in enumerate(reports):
        assert report["barrier"]["calls"] == ["all_reduce"]
        assert report["barrier"]["left"] >= last_arrival, rank


def test_every_staged_function_has_distributed_c10ds_own_signature():
    use_working_tree()
    from vllm_omni.distributed.persistent_collectives import KINDS, STAGED

    for name in KINDS:
        assert getattr(c10d, name) is not STAGED[name]  # the oracle is torch's own function
        assert (
            inspect.signature(STAGED[name]).parameters.keys()
            == inspect.signature(getattr(c10d, name)).parameters.keys()
        )
        defaults = [p.default for p in inspect.signature(STAGED[name]).parameters.values()]
        assert defaults == [p.default for p in inspect.signature(getattr(c10d, name)).parameters.values()], name


def test_an_average_goes_to_the_plain_collective_which_divides_in_the_callers_tensor(reports):
    for report in reports:
        assert report["plain"]["average_saved_for_backward"]["raised"] == "RuntimeError"
        assert report["plain"]["average_of_integers"]["raised"] is not None
        for case in ("average_saved_for_backward", "average_of_integers"):
            assert report["staged"][case]["_staged"] == 0, case


def test_a_barrier_lands_the_results_of_the_groups_earlier_asynchronous_calls(reports):
    for rank, report in enumerate(reports):
        plain = report["plain"]["barrier_after_async_work"]
        assert plain["seen"] == plain["tensor"], rank  # the oracle: gloo's barrier waits for earlier work
        assert report["staged"]["barrier_after_async_work"]["_staged"] == 2, rank


def test_a_barrier_on_a_rank_without_a_workspace_is_the_same_collective_as_its_peers(reports):
    for rank, report in enumerate(reports):
        outcome = report["barrier_without_workspace"]
        assert outcome["returned"] is None and outcome["calls"] == ["all_reduce"], rank
        assert outcome["fallbacks"] == (1 if rank == 1 else 0), rank


def test_calls_on_one_tensor_act_in_the_order_they_were_issued(reports):
    # The oracle here is a device backend's stream order: gloo runs the two plain calls on its own threads, and
    # their result varies from run to run.
    total = sum(data(rank, (6,), torch.int64, 19) for rank in range(WORLD))
    for rank, report in enumerate(reports):
        assert report["staged"]["chained_on_one_tensor"]["tensor"] == bits(WORLD * total).tolist(), rank
        assert report["staged"]["chained_on_one_tensor"]["_staged"] == 2, rank


def test_torchs_own_nested_calls_reach_the_function_the_layer_replaced_and_are_not_counted(reports):
    # torch's all_gather_into_tensor calls distributed_c10d's all_gather_single, which the layer also replaces.
    for report in reports:
        staged = report["staged"]["gather_output_saved_for_backward"]
        assert staged["_staged"] == 2 and staged["_passed"] == 0


def test_a_wait_that_times_out_leaves_the_call_in_flight_and_a_later_wait_lands_it(reports):
    for report in reports:
        assert report["plain"]["wait_that_times_out_then_succeeds"]["first_wait"] in ("timed out", None)
        assert report["staged"]["wait_that_times_out_then_succeeds"]["_staged"] == 2
