# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The diffusion ``GroupCoordinator`` compiled where its process stages: whole graphs through the registered ops, on
gloo ranks."""

from __future__ import annotations

import pytest

from tests.distributed import traced_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]


@pytest.fixture(scope="module")
def compiled():
    return results_or_raise(run_ranks(traced_ranks.compile_checks, 2, timeout_s=900), 2)


def test_compiled_whole_graph_the_coordinator_adds_no_graph_break_and_keeps_the_plain_results(compiled):
    for report in compiled:
        assert report["aot_eager"]["graph_breaks"] == 0 and report["aot_eager"]["equal"]


def test_compiled_with_staging_on_every_call_reaches_the_backend_through_blocks(compiled):
    for report in compiled:
        assert report["aot_eager"]["staged_calls"] > 0 and report["aot_eager"]["staged_unmanaged"] == 0


def test_compiled_aot_eager_equals_the_eager_plain_module(compiled):
    assert all(report["aot_eager_equals_eager"] for report in compiled)


def test_compiled_the_all_reduce_is_in_place_as_eager_for_a_caller_that_ignores_the_return_value(compiled):
    assert all(report["in_place_compiled_equals_eager"] for report in compiled)


def test_compiled_the_all_reduce_of_a_strided_view_lands_in_the_view_with_the_eager_bits(compiled):
    assert all(report["strided_compiled_equals_eager"] for report in compiled)


def test_compiled_whole_graph_staging_holds_one_op_of_ours_for_each_collective_and_none_of_torchs():
    for graphs, ops in results_or_raise(run_ranks(traced_ranks.whole_graph_ops, 2, timeout_s=600), 2):
        assert graphs == 1 and ops == ["vllm_omni.all_gather", "vllm_omni.all_reduce", "vllm_omni.broadcast"]


def test_each_reduce_op_the_ops_carry_goes_by_its_name_and_one_they_do_not_is_left_to_torch():
    import torch.distributed as dist

    from vllm_omni.distributed import traced_collectives

    for name, op in traced_collectives.REDUCE_OPS.items():
        assert traced_collectives.reduce_name(op) == name
    assert traced_collectives.reduce_name(dist.ReduceOp.PREMUL_SUM) is None  # compiled: torch's own, graph break
