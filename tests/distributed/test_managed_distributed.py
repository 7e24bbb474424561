# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Every collective ``managed_distributed`` stages, as a request-path module calls it, on four gloo ranks: eager and
compiled whole-graph (``aot_eager``, dynamic shapes), with ``torch.distributed`` as the oracle; and in
the request pool, torch's own on every rank (the pool a stand-in for ``torch.xpu``'s)."""

from __future__ import annotations

import pytest

from tests.distributed import managed_ranks, pool_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

WORLD = 4


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(managed_ranks.checks, WORLD, timeout_s=900), WORLD)


@pytest.mark.parametrize("switch", ["0", "1"])
def test_eager_every_kind_gives_torchs_bits_switch_off_and_on(reports, switch):
    assert all(report[f"eager{switch}"][0] == report["oracle"] for report in reports)


def test_eager_async_and_point_to_point_calls_give_torchs_bits_and_return_what_torch_returns(reports):
    assert all(report["extras1"] == report["extras0"] == report["extras_oracle"] for report in reports)


def test_compiled_the_switch_on_gives_the_results_of_the_switch_off(reports):
    assert all(report["aot_eager1"][0] == report["aot_eager0"][0] for report in reports)


def test_compiled_aot_eager_gives_torchs_eager_bits(reports):
    assert all(report["aot_eager1"][0] == report["oracle"] for report in reports)


def test_compiled_staging_off_breaks_the_graph_where_torchs_own_does_and_staged_every_kind_is_one_graph(reports):
    for report in reports:
        assert (
            report["graphs0"] == report["graphsrelease"] > report["graphs1"] == 1
        )  # torch's broadcast, list all_to_all


def test_compiled_staging_off_holds_torchs_functional_collectives_as_the_release_does_and_none_of_ours(reports):
    for report in reports:
        assert report["ops0"] == report["opsrelease"] and "_c10d_functional.all_reduce" in report["ops0"]
        assert not [op for op in report["ops0"] if op.startswith("vllm_omni.")]
        assert not [op for op in report["ops1"] if op.startswith("_c10d_functional.")]
        assert "vllm_omni.all_reduce" in report["ops1"]


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_staged_the_backend_is_handed_only_blocks_and_plain_eager_it_is_handed_the_callers_tensors(reports, mode):
    for report in reports:
        assert report[f"{mode}1"][1]["calls"] > 0 and report[f"{mode}1"][1]["unmanaged"] == 0, report[mode + "1"]
        assert report["eager0"][1]["unmanaged"] > 0  # compiled off, torch's functional collectives: see ops0


def test_staged_async_and_point_to_point_calls_hand_the_backend_only_blocks(reports):
    assert all(report["extras_unmanaged0"] > 0 and report["extras_unmanaged1"] == 0 for report in reports)


def test_point_to_point_calls_are_torchs_own_with_staging_off_and_staged_batches_with_it_on(reports):
    # Off, a send is torch's send, not a batch: NCCL wants every rank in a group's first batch.
    for report in reports:
        assert report["extras_calls0"] == ["all_reduce"], report["extras_calls0"]
        assert report["extras_calls1"] == ["all_reduce", *["batch_isend_irecv"] * 4], report["extras_calls1"]


@pytest.mark.parametrize("switch", ["0", "1"])
def test_what_staging_leaves_to_torch_or_must_answer_alike_gives_torchs_answers(reports, switch):
    # Async futures, a group without this rank, unlike dtypes (refused), a compiled one-sided all-to-all.
    fields = ("future", "non_member", "gather_float64", "scatter_float64", "compiled_one_sided")
    for report in reports:
        assert {k: report[f"edges{switch}"][k] for k in fields} == {k: report["edges_oracle"][k] for k in fields}


def test_async_calls_are_torchs_own_with_staging_off_and_a_finished_work_with_it_on(reports):
    # Off (CUDA, or the switch at 0), async_op=True keeps torch's overlap; on, the call has run when it returns.
    assert all(r["edges0"]["torchs_work"] and not r["edges1"]["torchs_work"] for r in reports)


def test_point_to_point_on_a_group_this_rank_is_not_in_returns_or_raises_what_plain_does(reports):
    # isend, irecv and recv return what torch's do; send raises torch's ValueError; the tensor is left alone.
    for rank, report in enumerate(checks["non_member_point_to_point"] for checks in reports):
        if rank not in (0, 2):
            assert report["staged"] == report["plain"], rank
            assert report["plain"]["untouched"] and report["plain"]["send"].startswith("ValueError"), report


@pytest.fixture(scope="module")
def pool_reports():
    return results_or_raise(run_ranks(pool_ranks.checks, WORLD, timeout_s=600), WORLD)


@pytest.mark.parametrize("run", ["in_request", "outside_request", "in_request_again"])
def test_ranks_that_disagree_on_where_a_tensor_lives_run_the_same_wire_collectives_with_plains_bits(pool_reports, run):
    # Rank 0 hands over the request's tensors, the others tensors made before it; every call is three times the cap.
    assert all(report[run]["equal"] for report in pool_reports)
    assert len({tuple(report[run]["calls"]) for report in pool_reports}) == 1, [r[run]["calls"] for r in pool_reports]
    assert len(pool_reports[0][run]["calls"]) == 7  # one backend call per collective: nothing chunked


@pytest.mark.parametrize("run", ["in_request", "outside_request", "in_request_again"])
def test_pool_mode_stages_nothing_makes_no_block_and_never_asks_the_pool_what_it_holds(pool_reports, run):
    for report in pool_reports:
        assert report["snapshots"] == 0
        stats = report[run]["stats"]
        assert not report[run]["staged"] and stats["staged_calls"] == stats["blocks"] == stats["staged_bytes"] == 0


def test_every_rank_made_one_pool_and_entered_it_for_each_request(pool_reports):
    assert [(r["pools_made"], r["pool_requests"], r["active_after"]) for r in pool_reports] == [(1, 2, False)] * WORLD
