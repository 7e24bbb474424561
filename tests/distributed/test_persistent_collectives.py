# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The persistent collectives' blocks on real gloo ranks, with the plain collectives as the oracle, and the switches
that choose them."""

from __future__ import annotations

import pytest

from tests.distributed import collective_ranks
from tests.distributed.ranks import results_or_raise, run_ranks

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.parallel]

WORLD = 4


def test_a_call_that_finds_its_block_busy_runs_on_its_own_tensors_and_leaves_the_block_alone():
    for report in results_or_raise(run_ranks(collective_ranks.busy_block, WORLD, timeout_s=300), WORLD):
        assert report == {"equal": True, "block_kept": True, "fallbacks": 1}


def test_on_two_ranks_a_float_sum_goes_in_chunks_with_the_plain_bits():
    for report in results_or_raise(run_ranks(collective_ranks.capped_blocks_two_ranks, 2, timeout_s=300), 2):
        assert report == {"equal": True, "chunked_calls": 1, "resident_bytes": 1 << 20}


def test_ranks_that_differ_in_grad_layout_or_a_free_block_run_the_same_pieces_and_finish_with_plain_bits():
    reports = results_or_raise(run_ranks(collective_ranks.capped_disagreement, WORLD, timeout_s=300), WORLD)
    for rank, report in enumerate(reports):
        assert report == {"equal": dict.fromkeys(report["equal"], True), "chunked_calls": 3}, rank
        assert len(report["equal"]) == 3


def test_a_block_grows_geometrically_so_sizes_rising_call_after_call_make_few_blocks_not_one_each():
    for report in results_or_raise(run_ranks(collective_ranks.rising_sizes, 2, timeout_s=300), 2):
        assert report["calls"] == 12 and report["allocations"] <= 6, report  # exact growth: one per call, 12
        assert report["resident_bytes"] <= 2 * int(16 * 1024 * 1.25**11), report


def test_a_block_used_on_another_stream_is_ordered_after_its_last_use_before_it_is_written():
    (report,) = results_or_raise(run_ranks(collective_ranks.streams, 1, timeout_s=120), 1)
    copies = ["copy on main", "copy on main"]
    assert report["log"] == [
        "call on main",
        *copies,
        "call on main",
        *copies,
        "call on side",
        "side waits for main",
        "copy on side",
        "copy on side",
        "call on side",
        "copy on side",
        "copy on side",
        "call on main",
        "main waits for side",
        *copies,
    ]
    assert report["blocks"] == 1


@pytest.mark.parametrize("raw", ["0", "-1", "1.5", "64MiB", "", " ", "\u0663"])
def test_a_block_cap_that_is_not_a_whole_number_of_mib_from_1_is_an_error_naming_it(raw):
    from vllm_omni.distributed import persistent_collectives as pc

    with pytest.raises(ValueError, match=f"{pc.CAP_ENV}={raw!r} is not valid; expected a whole number of MiB"):
        pc.parse_block_cap(raw)


def test_the_block_cap_defaults_to_64_mib_and_reads_whole_mib():
    from vllm_omni.distributed import persistent_collectives as pc

    assert pc.parse_block_cap(None) == 64 << 20 and pc.parse_block_cap(" 8 ") == 8 << 20


def test_with_the_request_pool_auto_picks_torchs_own_collectives_and_1_is_refused_by_name(monkeypatch):
    from vllm_omni.distributed import persistent_collectives as pc

    monkeypatch.setenv(pc.POOL_ENV, "1")
    monkeypatch.setenv(pc.SWITCH_ENV, "auto")
    assert not pc.collectives_for("xpu").staged and not pc.collectives_for("cpu").staged
    monkeypatch.setenv(pc.SWITCH_ENV, "1")
    with pytest.raises(ValueError, match=rf"^{pc.SWITCH_ENV}=1 and {pc.POOL_ENV}=1 each keep .* set one of them"):
        pc.collectives_for("xpu")
    monkeypatch.setenv(pc.POOL_ENV, "0")
    monkeypatch.setenv(pc.SWITCH_ENV, "auto")
    assert pc.collectives_for("xpu").staged and not pc.collectives_for("cpu").staged


def test_a_coordinator_made_with_staging_and_the_pool_both_on_stops_the_start_up_naming_both(monkeypatch):
    from vllm_omni.distributed import persistent_collectives as pc

    monkeypatch.setenv(pc.POOL_ENV, "1")
    monkeypatch.setenv(pc.SWITCH_ENV, "1")
    with pytest.raises(ValueError, match=rf"^{pc.SWITCH_ENV}=1 and {pc.POOL_ENV}=1 each keep"):
        pc.register_coordinator(object())  # before anything of the coordinator is read


@pytest.mark.parametrize("raw", ["pool", "", "yes", "2"])
def test_a_switch_value_other_than_auto_1_or_0_is_refused_naming_it(monkeypatch, raw):
    from vllm_omni.distributed import persistent_collectives as pc

    monkeypatch.setenv(pc.SWITCH_ENV, raw)
    with pytest.raises(ValueError, match=rf"^{pc.SWITCH_ENV}={raw!r} is not valid; expected one of 'auto', '1'"):
        pc.switch_mode()
