# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The persistent-buffer layer on four real gloo ranks, against the plain collectives.

The ranks start once per module and run every check (``layer_ranks.checks``); each test asserts one property.
"""

from __future__ import annotations

import pytest

from tests.distributed import layer_ranks
from tests.utils import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 4
KINDS = tuple(layer_ranks.kinds(0, WORLD, layer_ranks.DTYPES[0], 0))


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(layer_ranks.checks, WORLD, timeout_s=600), WORLD)


@pytest.mark.parametrize("dtype", layer_ranks.DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_returns_the_plain_collectives_bits_on_every_rank(reports, kind, dtype):
    assert [r["equal"][f"{kind}/{dtype}"] for r in reports] == [True] * WORLD


def test_the_backend_is_handed_only_workspaces_and_the_same_ones_from_the_second_request_on(reports):
    for rank, report in enumerate(reports):
        first, second, third = (report["addresses"][i] for i in range(3))
        # Request 1 may also hand over blocks that a larger call then replaced; never afterwards.
        assert second["handed"] == third["handed"] and set(second["handed"]) <= set(first["workspaces"]), rank
        assert first["allocations"] == second["allocations"] == third["allocations"], rank


def test_no_result_aliases_a_workspace_and_no_caller_tensor_reaches_the_backend(reports):
    assert [r["aliases"] for r in reports] == [[]] * WORLD


def test_an_in_place_collective_leaves_its_result_in_the_callers_tensor(reports):
    assert all(r["in_place"] for r in reports)


def test_an_async_collective_copies_out_only_when_waited_and_two_in_flight_hold_two_workspaces(reports):
    for report in reports:
        assert report["async"]["untouched_before_wait"] and report["async"]["after_wait"]
        assert report["async"]["busy_in_flight"] == 2 and report["async"]["busy_after_wait"] == 0
        assert report["async"]["work_type"] == "StagedWork"
        assert "call wait() instead" in report["async"]["get_future"]


def test_a_persistent_block_is_handed_to_the_backend_as_it_is(reports):
    assert all(r["persistent_passed_through"] for r in reports)


def test_a_rank_without_memory_for_a_workspace_runs_the_plain_collective_and_logs_once(reports):
    for rank, report in enumerate(reports):
        fallback = report["fallback"]
        assert fallback["values"] == fallback["expected"], rank
        if rank == 1:
            assert fallback["fallbacks"] == 3 and fallback["warned"] == [("all_reduce", "memory")]
            assert "no workspace of 262144 bytes on cpu" in fallback["reasons"][0]
        else:
            assert fallback["fallbacks"] == 0 and fallback["reasons"] == []


def test_a_workspace_reserved_before_the_first_call_serves_it_without_allocating(reports):
    for report in reports:
        reserved = report["reserved"]
        assert reserved["bytes"] == 1536 and reserved["allocations"] == 1  # 1320 bytes, aligned to 512
        assert reserved["allocations_after_first_call"] == 1
        assert reserved["bad"] == "nbytes=0: expected a positive int"


def test_uninstall_puts_the_plain_collectives_back(reports):
    assert all(r["uninstalled"] for r in reports)
