# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Pool mode: the switch, the worker's request pool and what it refuses. The pool API is a stand-in for
``torch.xpu``'s (``mem_pool_stand_in``; no XPU or caching allocator here): these tests prove when the pool is in
use and on which device, not where the allocator puts memory."""

from __future__ import annotations

import re
import types

import pytest
import torch

from tests.distributed import mem_pool_stand_in as mem_pool
from vllm_omni.distributed import request_pool

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion, pytest.mark.distributed]

CPU = torch.device("cpu")


@pytest.fixture
def pool():
    return request_pool.RequestPool(mem_pool, CPU)


def test_the_switch_takes_pool_and_names_it_among_the_values_it_expects(monkeypatch):
    monkeypatch.setenv(request_pool.SWITCH_ENV, " Pool ")
    assert request_pool.switch_mode() == "pool"
    monkeypatch.setenv(request_pool.SWITCH_ENV, "pools")
    with pytest.raises(ValueError, match=r"VLLM_OMNI_PERSISTENT_COLLECTIVES='pools' is not valid; .*'pool'"):
        request_pool.switch_mode()


def test_pool_mode_refuses_a_torch_whose_device_module_has_no_mem_pool_naming_the_version():
    expected = rf"torch\.cpu\.MemPool .* torch {re.escape(torch.__version__)} does not have"
    with pytest.raises(RuntimeError, match=expected):
        request_pool.pool_api(types.SimpleNamespace(device_type="cpu"))


def test_on_xpu_the_pool_is_torch_xpus_own_and_a_platform_may_name_another():
    assert request_pool.pool_api(types.SimpleNamespace(device_type="xpu")) is torch.xpu  # torch 2.13 has it
    platform = types.SimpleNamespace(device_type="cpu", mem_pool_api=lambda: mem_pool)
    assert request_pool.pool_api(platform) is mem_pool


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_XPU_ALLOC_CONF"])
@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:64, expandable_segments:true"])
def test_expandable_segments_are_refused_naming_the_variable_its_value_and_what_to_set(name, conf):
    message = rf"^{name}='{re.escape(conf)}' turns on expandable segments.*remove expandable_segments:True from {name}"
    with pytest.raises(ValueError, match=message):
        request_pool.refuse_expandable_segments("xpu", {name: conf})


@pytest.mark.parametrize(
    "environ",
    [{}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}],
)
def test_an_allocator_without_expandable_segments_on_this_device_is_accepted(environ):
    request_pool.refuse_expandable_segments("xpu", environ)  # CUDA's variable is not the XPU allocator's


def test_the_pool_is_entered_on_the_device_it_was_made_for_never_the_current_one(pool):
    with pool.request():
        assert pool.active
    assert pool._pool.devices == [CPU] and pool.requests == 1


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


def test_the_worker_pool_is_made_once_and_outside_pool_mode_requests_run_in_no_pool(monkeypatch):
    monkeypatch.setattr(request_pool, "_worker", None)
    with request_pool.request_memory():
        assert request_pool.worker_pool() is None
    platform = types.SimpleNamespace(device_type="cpu", mem_pool_api=lambda: mem_pool, get_torch_device=lambda: CPU)
    made = mem_pool.MemPool.made
    first = request_pool.open_worker_pool(platform)  # the platform's current device, as the worker sets it
    assert request_pool.open_worker_pool(platform, "cpu") is first and mem_pool.MemPool.made == made + 1
    assert first.device == CPU
