# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""vLLM-Omni's diffusion ``GroupCoordinator`` through the platform's collectives, on gloo ranks, eager and compiled."""

from __future__ import annotations

import pytest

from tests.distributed import coordinator_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def eager():
    return results_or_raise(run_ranks(coordinator_ranks.eager_checks, 4, timeout_s=600), 4)


@pytest.fixture(scope="module")
def compiled():
    return results_or_raise(run_ranks(coordinator_ranks.compile_checks, 2, timeout_s=900), 2)


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


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_whole_graph_the_coordinator_adds_no_graph_break_and_keeps_the_plain_results(compiled, backend):
    for report in compiled:
        result = report[backend]
        assert result["graph_breaks"] == 0 and result["close"]
        # aot_eager runs the traced ops as they are: the plain bits. Inductor fuses the code around torch's
        # functional collectives (staging off) otherwise than around the registered ops: the last bits may differ.
        assert result["equal"] or backend == "inductor"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_with_staging_on_every_call_reaches_the_backend_through_blocks(compiled, backend):
    for report in compiled:
        assert report[backend]["staged_calls"] > 0 and report[backend]["staged_unmanaged"] == 0


def test_compiled_aot_eager_equals_the_eager_plain_module(compiled):
    assert all(report["aot_eager_equals_eager"] for report in compiled)


def test_compiled_the_all_reduce_is_in_place_as_eager_for_a_caller_that_ignores_the_return_value(compiled):
    assert all(report["in_place_compiled_equals_eager"] for report in compiled)


def test_compiled_the_all_reduce_of_a_strided_view_lands_in_the_view_with_the_eager_bits(compiled):
    assert all(report["strided_compiled_equals_eager"] for report in compiled)


def test_compiled_with_staging_off_the_graph_holds_torchs_functional_collectives_and_none_of_ours():
    reports = results_or_raise(run_ranks(coordinator_ranks.graph_checks, 2, timeout_s=600), 2)
    for report in reports:
        assert report["0"] == [
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.all_reduce",
            "_c10d_functional.wait_tensor",
        ]
        assert report["1"] == ["vllm_omni.all_gather", "vllm_omni.all_reduce", "vllm_omni.broadcast"]  # one graph
