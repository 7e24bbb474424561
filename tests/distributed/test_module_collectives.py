# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Every kind the request path stages, the modules' beside the coordinator's, on real gloo ranks, with the plain
collectives as the oracle.

The ranks start once per fixture and run every check (``module_ranks.checks``); each test asserts one property.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import contract_ranks, module_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

WORLD = 4
KINDS = tuple(module_ranks.kinds(0, WORLD, module_ranks.DTYPES[0], 0))
STAGED_NAMES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(module_ranks.checks, WORLD, timeout_s=600), WORLD)


@pytest.mark.parametrize("dtype", module_ranks.DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_the_plain_collectives_bits_and_leaves_its_inputs_as_plain_does(reports, kind, dtype):
    assert [r["equal"][f"{kind}/{dtype}"] for r in reports] == [True] * WORLD


def test_from_the_second_request_on_the_backend_is_handed_no_new_buffer_and_only_blocks(reports):
    for rank, report in enumerate(reports):
        first, *later = report["staged_only"]
        assert first["fresh"] > 0 and [r["fresh"] for r in later] == [0, 0], rank
        assert all(r["unmanaged"] == 0 and r["calls"] > 0 for r in report["staged_only"]), rank  # barrier too
        assert report["allocations_after_request_1"] == 0, rank


def test_the_plain_path_hands_the_backend_the_callers_tensors_so_a_regression_would_show(reports):
    # The oracle half of every request is plain: the same recorder counts it as unmanaged and fresh every request.
    for report in reports:
        assert all(r["unmanaged"] > 0 and r["fresh"] > 0 for r in report["requests"])


def test_no_tensor_handed_back_aliases_a_block(reports):
    assert [r["aliases"] for r in reports] == [[]] * WORLD


def test_a_staged_barrier_holds_every_rank_until_the_last_arrives(reports):
    assert all(r["barrier_waited_s"] >= 0.4 for r in reports), [r["barrier_waited_s"] for r in reports]


def test_a_rank_without_memory_runs_the_plain_collectives_alone_and_logs_each_kind_once(reports):
    for rank, report in enumerate(reports):
        fallback = report["fallback"]
        assert fallback["equal"], rank  # every rank's results, the failing one's included, are the oracle's
        if rank == 1:
            assert fallback["fallbacks"] == len(KINDS) + 1  # and the barrier, which all-reduces a fresh element
            names = sorted(warning.split()[1] for warning in fallback["warnings"])  # once per collective
            assert names == sorted(STAGED_NAMES), fallback["warnings"]
            assert "no block of 140 bytes on cpu: injected" in fallback["warnings"][0]
        else:
            assert fallback["fallbacks"] == 0 and fallback["warnings"] == [], rank


@pytest.fixture(scope="module")
def four():
    return results_or_raise(run_ranks(contract_ranks.four_rank_checks, WORLD, timeout_s=900), WORLD)


@pytest.fixture(scope="module")
def three():
    # A stalled batch would hold every rank until the group timeout: 30 s here.
    return results_or_raise(run_ranks(contract_ranks.three_rank_checks, 3, timeout_s=300, pg_timeout_s=30), 3)


def test_batches_nobody_waited_for_yet_keep_their_blocks_the_pool_grows_past_them_and_they_land_when_waited(four):
    for report in (checks["abandoned_batches"] for checks in four):
        assert report["waited_equal"] and report["fallbacks"] == 0
        assert report["blocks"] == (9, 10)  # one per batch in flight; the two waited ones shared the tenth
        assert report["landed_before_wait"] == [False] * 9  # a receive lands when its batch is waited, not before
        assert report["landed"] == [True] * 9
        assert report["new_allocations_in_request_2"] == 0


@pytest.fixture(params=[3, 4], ids=lambda world: f"{world}_ranks")
def defects(request):
    """The defect checks' reports on every rank, from the start of three ranks and the start of four."""
    return [checks for checks in request.getfixturevalue("three" if request.param == 3 else "four")]


def test_a_refused_call_raises_plains_error_and_the_next_call_lands_in_the_same_block(defects):
    for rank, report in enumerate(checks["error_paths"] for checks in defects):
        for case, outcome in report.items():
            assert outcome["plain"].startswith(("RuntimeError", "ValueError")), (rank, case, outcome)
            assert outcome["staged"] == outcome["plain"], (rank, case)
            assert outcome["busy_after_error"] == [False] * len(outcome["busy_after_error"]), (rank, case)
            assert outcome["equal"] and outcome["same_block"] and outcome["fallbacks"] == 0, (rank, case, outcome)


def test_a_list_gather_given_a_list_of_the_wrong_length_raises_gloos_error_naming_the_list(defects):
    for report in (checks["error_paths"] for checks in defects):
        world = len(defects)
        for case, length in (("list_too_short", world - 1), ("list_too_long", world + 1)):
            assert (
                f"invalid output tensor list at index 0 (expected length {world}, got {length})"
                in (report[case]["staged"])
            )


def test_more_batches_in_flight_than_ever_before_complete_at_once_with_plain_bits(defects):
    for report in (checks["deep_ring"] for checks in defects):
        assert report["equal"] and report["fallbacks"] == 0
        assert report["slowest_s"] < 10, report["slowest_s"]  # a stall lasts the 30 s group timeout
        assert report["blocks"] == report["allocations"] == 12  # one per batch in flight, reused by request 2


def test_blocks_first_used_in_inference_mode_are_written_outside_it_and_back_with_plain_bits(defects):
    for report in (checks["inference_mode_blocks"] for checks in defects):
        assert report["failed"] == {}
        assert report["equal"] == dict.fromkeys(report["equal"], True) and len(report["equal"]) == 14
        assert report["fallbacks"] == 0


def test_an_output_autograd_guards_is_accepted_or_refused_as_plain_gloo_does(defects):
    for report in (checks["grad_outputs"] for checks in defects):
        assert {case: outcome["staged"] for case, outcome in report.items()} == {
            case: outcome["plain"] for case, outcome in report.items()
        }
    refused = sorted(case for case, outcome in report.items() if isinstance(outcome["plain"], str))
    assert refused  # gloo refuses some of them: the check compares refusals, not only bits


def test_batches_in_flight_are_posted_at_once_as_torch_posts_them_and_each_finished_by_its_own_wait(three):
    # Each rank's receive that matches its peer's first batch is in its own second batch: waiting for the first
    # batch before posting the second would stall every rank until the group timeout.
    for report in (checks["batches_in_flight"] for checks in three):
        assert report["equal"] and report["fallbacks"] == 0
        assert report["slowest_s"] < 10, report["slowest_s"]
        assert report["blocks"] == 2 and report["allocations"] == 2  # a pool of two, reused by every later request


def test_the_staged_batchs_work_answers_wait_is_completed_exception_and_future_as_a_plain_gloo_batch_does(three):
    for report in (checks["batch_work"] for checks in three):
        assert (
            report["wait"]["staged"]
            == report["wait"]["plain"]
            == {
                "received": True,
                "completed": (False, True),
                "exception": [],
            }
        )
        assert report["future"]["staged"] == report["future"]["plain"] == {"raised": "Work::getFuture not implemented."}
        assert report["fallbacks"] == 0


def test_on_a_group_this_rank_is_not_in_every_kind_returns_and_leaves_its_tensors_as_plain_does(four):
    for rank, report in enumerate(checks["non_member"] for checks in four):
        assert report["staged"]["outcome"] == report["plain"]["outcome"] == "ok", rank
        if rank >= 2:
            assert report["staged"]["untouched"] and report["plain"]["untouched"], rank


@pytest.fixture(scope="module")
def capped(four):
    return [checks["capped_blocks"] for checks in four]


def test_calls_above_the_cap_go_in_chunks_through_a_block_within_the_cap_with_the_plain_bits(capped):
    for report in capped:
        kinds = ("broadcast", "all_gather", "all_to_all", "all_reduce_int", "list_gather")
        assert report["equal"] == dict.fromkeys(kinds, True)
        assert report["chunked_calls"] == 2 * len(kinds)  # every kind, both requests
        assert 0 < report["resident_bytes"] <= 1 << 20 and report["allocations"] == 1


def test_a_float_sum_on_more_than_two_ranks_is_staged_whole_above_the_cap_because_chunks_change_its_bits(capped):
    for report in capped:
        assert report["chunks_would_differ"], "gloo's order of summation no longer depends on the message size"
        assert report["float_equal"] and report["float_resident_bytes"] > 1 << 20


def test_a_rank_without_a_block_runs_the_same_chunks_on_its_own_tensors_so_no_peer_hangs(four):
    for rank, report in enumerate(checks["capped_fallback"] for checks in four):
        assert report["equal"], rank
        assert report["fallbacks"] == (4 if rank == 1 else 0), rank


class _FailingWork(dist.Work):
    """Test-only: a backend's work whose wait raises, as a timed-out receive's does (a real one closes gloo's pair)."""

    def wait(self, timeout=None):
        raise RuntimeError("injected: the peer never posted its send")


def test_a_staged_batch_whose_wait_raises_frees_its_block_and_writes_nothing_to_the_callers_tensor():
    from vllm_omni.distributed import module_collectives as mc
    from vllm_omni.distributed import persistent_collectives as pc

    block = pc.StagingBlock()
    block.ensure(512, "cpu")
    block.busy = True
    staged, received = block.view((4,), torch.float32).fill_(1.0), torch.full((4,), 7.0)
    batch = mc._StagedBatch([_FailingWork()], [(received, staged)], block)
    with pytest.raises(RuntimeError, match="injected"):
        batch.wait()
    assert not block.busy and torch.equal(received, torch.full((4,), 7.0))


def test_the_modules_calls_share_the_coordinators_block_of_their_group():
    for report in results_or_raise(run_ranks(module_ranks.shared_blocks, 2, timeout_s=300), 2):
        assert report == {"blocks": 1, "shared": True}
