# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Pool mode: the switch, the worker's request pool and the collectives' routing by it, with the plain collectives as
the oracle. The pool API is the CPU test platform's stand-in for ``torch.xpu``'s (no XPU or caching allocator
here): these tests prove when the pool is in use and what is routed where, not where the allocator puts memory."""

from __future__ import annotations

import re
import types

import pytest
import torch

from tests.distributed import mem_pool_stand_in as mem_pool
from tests.distributed import pool_ranks
from tests.distributed.ranks import results_or_raise, run_ranks
from vllm_omni.distributed import persistent_collectives as pc
from vllm_omni.distributed import request_pool

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

WORLD = 4


@pytest.fixture
def pool():
    return request_pool.RequestPool(mem_pool)


def test_the_switch_takes_pool_and_names_it_among_the_values_it_expects(monkeypatch):
    monkeypatch.setenv(pc.SWITCH_ENV, " Pool ")
    assert pc.switch_mode() == "pool"
    monkeypatch.setenv(pc.SWITCH_ENV, "pools")
    with pytest.raises(ValueError, match=r"VLLM_OMNI_PERSISTENT_COLLECTIVES='pools' is not valid; .*'pool'"):
        pc.switch_mode()


def test_pool_mode_picks_the_pooled_collectives_on_any_platform_and_auto_stays_staging(monkeypatch):
    monkeypatch.setenv(pc.SWITCH_ENV, "pool")
    chosen = pc.collectives_for("xpu")
    assert chosen.staged and chosen.pooled and pc.collectives_for("cpu") is chosen
    monkeypatch.setenv(pc.SWITCH_ENV, "auto")
    assert not pc.collectives_for("xpu").pooled and pc.collectives_for("xpu").staged


def test_pool_mode_refuses_a_torch_whose_device_module_has_no_mem_pool_naming_the_version():
    expected = rf"torch\.cpu\.MemPool .* torch {re.escape(torch.__version__)} does not have"
    with pytest.raises(RuntimeError, match=expected):
        request_pool.pool_api(types.SimpleNamespace(device_type="cpu"))


def test_on_xpu_the_pool_is_torch_xpus_own_and_a_platform_may_name_another():
    assert request_pool.pool_api(types.SimpleNamespace(device_type="xpu")) is torch.xpu  # torch 2.13 has it
    platform = types.SimpleNamespace(device_type="cpu", mem_pool_api=lambda: mem_pool)
    assert request_pool.pool_api(platform) is mem_pool


def test_the_pool_holds_what_a_request_makes_and_nothing_made_before_it(pool):
    weight = torch.randn(64)
    with pool.request():
        activation = torch.randn(256)
        kept = torch.randn(8)  # outlives the request, as a workspace made in it does
        assert pool.active and pool.holds(activation) and not pool.holds(weight)
    with pool.request():
        assert pool.holds(kept) and not pool.holds(weight)  # the pool keeps its segments across requests
    assert not pool.active and pool.requests == 2


def test_an_exception_inside_a_request_leaves_the_pool_context_closed_and_the_next_request_enters_it(pool):
    with pytest.raises(RuntimeError, match="in the forward"), pool.request():
        raise RuntimeError("in the forward")
    assert not pool.active and pool._pool.depth == 0
    with pool.request():
        assert pool.active
    assert pool._pool.entries == 2


def test_an_entry_point_called_from_another_enters_the_pool_once(pool):
    with pool.request(), pool.request():
        assert pool._pool.depth == 1
    assert pool.requests == 1 and not pool.active


def test_without_a_running_request_nothing_counts_as_the_pools(pool, monkeypatch):
    monkeypatch.setattr(request_pool, "_worker", pool)
    with pool.request():
        made = torch.randn(4)
        assert request_pool.holds_all([made]) and request_pool.holds_all([])
    assert not request_pool.holds_all([made]) and not request_pool.holds_all([])


def test_the_worker_pool_is_made_once_and_outside_pool_mode_requests_run_in_no_pool(monkeypatch):
    monkeypatch.setattr(request_pool, "_worker", None)
    with request_pool.request_memory():
        assert request_pool.worker_pool() is None
    platform = types.SimpleNamespace(device_type="cpu", mem_pool_api=lambda: mem_pool)
    made = mem_pool.MemPool.made
    first = request_pool.open_worker_pool(platform)
    assert request_pool.open_worker_pool(platform) is first and mem_pool.MemPool.made == made + 1


@pytest.fixture(scope="module")
def reports():
    return results_or_raise(run_ranks(pool_ranks.checks, WORLD, timeout_s=600), WORLD)


def test_in_a_request_tensors_it_made_go_to_torch_unstaged_with_the_plain_bits(reports):
    for report in reports:
        for run in ("request_made", "request_made_again"):
            assert report[run] == {
                "equal": True,
                "pooled_calls": pool_ranks.KINDS,
                "staged_calls": 0,
                "block_allocations": 0,
            }


def test_in_a_request_tensors_made_before_it_are_staged_with_the_plain_bits(reports):
    for report in reports:
        run = report["made_before"]
        assert run["equal"] and run["staged_calls"] == pool_ranks.KINDS - 1  # the barrier has no tensor: the pool's
        assert run["pooled_calls"] == 1 and run["block_allocations"] > 0


def test_outside_a_request_every_call_is_staged_as_in_the_default_mode(reports):
    for report in reports:
        run = report["outside_request"]
        assert run["equal"] and run["staged_calls"] == pool_ranks.KINDS and run["pooled_calls"] == 0


def test_every_rank_made_one_pool_and_entered_it_for_each_request(reports):
    assert [(r["pools_made"], r["pool_requests"], r["active_after"]) for r in reports] == [(1, 3, False)] * WORLD
