# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The worker's request pool: its switch, what it refuses, and its life in the diffusion worker (made with the device,
entered around each request, released by ``sleep()``, made again by ``wake_up()``). The pool API is a stand-in for
``torch.xpu``'s (``mem_pool_stand_in``; no XPU or caching allocator here): these tests prove when the pool is in
use and on which device, not where the allocator puts memory."""

from __future__ import annotations

import re
import types
import weakref

import pytest
import torch

from tests.distributed import mem_pool_stand_in as mem_pool
from vllm_omni.distributed import request_pool

pytestmark = [pytest.mark.core_model, pytest.mark.cpu, pytest.mark.diffusion]

CPU = torch.device("cpu")


@pytest.fixture
def pool():
    return request_pool.RequestPool(mem_pool, CPU)


@pytest.mark.parametrize("raw,enabled", [(None, False), ("0", False), ("1", True), (" 1 ", True)])
def test_the_switch_is_off_unless_set_to_1_and_the_diffusion_envs_declare_it(monkeypatch, raw, enabled):
    from vllm_omni.diffusion import envs

    monkeypatch.delenv(request_pool.POOL_ENV, raising=False) if raw is None else monkeypatch.setenv(
        request_pool.POOL_ENV, raw
    )
    assert request_pool.pool_enabled() is enabled
    assert ("0" if raw is None else raw) == envs.VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL  # raw, as upstream's envs are


@pytest.mark.parametrize("raw", ["", "pool", "true", "2", "auto"])
def test_any_other_switch_value_is_refused_naming_it_and_the_values_expected(monkeypatch, raw):
    monkeypatch.setenv(request_pool.POOL_ENV, raw)
    with pytest.raises(ValueError, match=rf"^VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL={raw!r} is not valid; expected '0'"):
        request_pool.pool_enabled()


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


def test_no_pool_is_made_unless_the_switch_is_on_and_requests_then_run_in_the_default_pool(monkeypatch):
    monkeypatch.delenv(request_pool.POOL_ENV, raising=False)
    made = mem_pool.MemPool.made
    assert request_pool.open_request_pool(_platform([]), CPU) is None and mem_pool.MemPool.made == made
    with request_pool.use_request_pool(None):
        pass


def test_a_pool_is_made_on_the_device_it_is_given_and_refuses_expandable_segments_first(monkeypatch):
    monkeypatch.setenv(request_pool.POOL_ENV, "1")
    pool = request_pool.open_request_pool(_platform([]), "cpu")
    assert pool.device == CPU and isinstance(pool._pool, mem_pool.MemPool)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    made = mem_pool.MemPool.made
    with pytest.raises(ValueError, match="expandable segments"):
        request_pool.open_request_pool(_platform([]), "cpu")
    assert mem_pool.MemPool.made == made


# The diffusion worker: its own sleep() and wake_up(), with its allocator and platform standing in for a card's.


def _platform(events):
    return types.SimpleNamespace(
        device_type="cpu",
        mem_pool_api=lambda: mem_pool,
        empty_cache=lambda: events.append("empty_cache"),
        synchronize=lambda *args: None,
        get_free_memory=lambda *args: 0,
        get_device_total_memory=lambda *args: 0,
    )


class _SleepAllocator:
    """vLLM's CuMemAllocator as sleep() and wake_up() use it, holding nothing."""

    @classmethod
    def get_instance(cls):
        return cls()

    def get_current_usage(self):
        return 0

    def sleep(self, offload_tags=()):
        pass

    def wake_up(self, tags=None):
        pass


@pytest.fixture
def worker(monkeypatch):
    """A DiffusionWorker past init_device (no process group here), in a process whose switch is on."""
    from vllm_omni.diffusion.worker import diffusion_worker

    events: list[str] = []
    platform = _platform(events)
    monkeypatch.setenv(request_pool.POOL_ENV, "1")
    monkeypatch.setattr(diffusion_worker, "current_omni_platform", platform)
    monkeypatch.setattr(diffusion_worker, "_get_cumem_allocator_class", lambda: _SleepAllocator)
    worker = object.__new__(diffusion_worker.DiffusionWorker)
    worker.rank, worker.device, worker.model_runner, worker.profiler = 0, CPU, None, None
    worker.od_config, worker._sleep_saved_buffers = types.SimpleNamespace(), {}
    worker.request_pool = request_pool.open_request_pool(platform, CPU)  # as init_device makes it
    worker.platform, worker.events = platform, events
    return worker


def test_sleep_releases_the_workers_pool_before_it_empties_the_cache_and_wake_up_makes_a_new_one(worker):
    pool = weakref.ref(worker.request_pool._pool)
    worker.platform.empty_cache = lambda: worker.events.append(("empty_cache", pool() is None))
    worker.sleep(level=1)
    # Gone before empty_cache(): the allocator then frees the free segments of a pool no longer alive.
    assert worker.events == [("empty_cache", True)]
    made = mem_pool.MemPool.made
    worker.wake_up()
    assert mem_pool.MemPool.made == made + 1 and worker.request_pool._pool is not None
    with worker.request_pool.request():
        assert worker.request_pool._pool.devices == [CPU]


def test_wake_up_without_a_sleep_keeps_the_pool_it_has(worker):
    pool = worker.request_pool._pool
    worker.wake_up()
    assert worker.request_pool._pool is pool


def test_shutdown_releases_the_pool_before_the_process_group_goes(worker, monkeypatch):
    from vllm_omni.diffusion.worker import diffusion_worker

    pool = weakref.ref(worker.request_pool._pool)
    seen = []
    monkeypatch.setattr(diffusion_worker, "destroy_distributed_env", lambda: seen.append(pool() is None))
    worker.shutdown()
    assert seen == [True]


def test_each_request_entry_point_runs_in_the_workers_pool_once(worker):
    seen = []

    class Runner:
        def execute_model(self, req, **kwargs):
            seen.append(("execute_model", worker.request_pool.active))
            return "output"

        def execute_model_batch(self, scheduler_output, od_config):
            seen.append(("execute_model_batch", worker.request_pool.active))

        def execute_stepwise(self, scheduler_output):
            seen.append(("execute_stepwise", worker.request_pool.active))

    worker.model_runner, worker.lora_manager = Runner(), None
    worker._activate_step_lora = lambda scheduler_output: None
    worker.execute_model(types.SimpleNamespace(), worker.od_config)
    worker.execute_model_batch(types.SimpleNamespace(scheduled_new_reqs=[]), worker.od_config)
    worker.execute_stepwise(types.SimpleNamespace())
    assert seen == [("execute_model", True), ("execute_model_batch", True), ("execute_stepwise", True)]
    assert worker.request_pool.requests == 3 and not worker.request_pool.active
