# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The persistent collectives on four real gloo ranks, with the plain collectives as the oracle.

The ranks start once per module and run every check (``collective_ranks.checks``); each test asserts one property.
"""

from __future__ import annotations

import pytest

from tests.distributed import collective_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 4
KINDS = tuple(collective_ranks.kinds(0, WORLD, collective_ranks.DTYPES[0], 0))
STAGED_NAMES = (
    "all_reduce",
    "all_gather_into_tensor",
    "broadcast",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(collective_ranks.checks, WORLD, timeout_s=600), WORLD)


@pytest.mark.parametrize("dtype", collective_ranks.DTYPES, ids=str)
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


def test_a_call_that_finds_its_block_busy_runs_on_its_own_tensors_and_leaves_the_block_alone():
    for report in results_or_raise(run_ranks(collective_ranks.busy_block, WORLD, timeout_s=300), WORLD):
        assert report == {"equal": True, "block_kept": True, "fallbacks": 1}


def test_a_batch_nobody_waited_is_finished_by_the_next_which_reuses_its_block():
    for report in results_or_raise(run_ranks(collective_ranks.abandoned_batch, WORLD, timeout_s=300), WORLD):
        assert report == {"equal": True, "fallbacks": 0, "dropped_batch_landed": True}
