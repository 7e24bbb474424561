# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""``vllm_omni.general_plugins`` entry point: a released vLLM-Omni gets the whole-request fix where upstream makes it.

Upstream, ``MiniMaxH3VideoVAE.__init__`` ends with ``install_tile_gather_reuse(self)`` and
``scope_remote_code(self.model)``, the platform and the coordinator own the request path's collectives, and the
diffusion worker keeps its request pool (``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1``) from ``init_device`` to
``sleep()``. vLLM-Omni loads this plugin in every process (API server, LLM stages, workers of any model), so it only
hooks: MiniMax-H3's adapter when its module is loaded, and a diffusion worker as it sets up its device. There,
where ``VLLM_OMNI_PERSISTENT_COLLECTIVES`` stages, it routes the request path's collectives (``request_path``); with
the pool it routes none and runs each request entry point in the worker's pool; with neither it leaves the worker and
every module as released. Any other process is left untouched.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
from types import ModuleType

from vllm.logger import init_logger

from . import serve_metrics
from .overlay import check_overlay, running
from .renamed import old_entry_point, old_pool_switch

# Under vLLM-Omni's logger, so its handlers and level apply: a top-level name would drop the INFO line.
logger = init_logger(f"vllm_omni.plugins.{__name__}")

ADAPTER_MODULE = "vllm_omni.diffusion.models.minimax_h3.vae"
WORKER_MODULE = "vllm_omni.diffusion.worker.diffusion_worker"
_HOOK_MARK = "_minimax_h3_tile_gather_hook"
_WORKER_MARK = "_persistent_collectives_hook"
# What the hook relies on: the adapter's setup takes the component path, and the adapter reads the
# checkpoint's parallel state the way install_tile_gather_reuse expects.
_EXPECTED_METHODS = ("set_parallel_size", "_native_parallel_state", "offload_to_cpu")
# The worker's entry points of a request: each runs inside the worker's request pool, where it has one.
REQUEST_ENTRY_POINTS = ("execute_model", "execute_model_batch", "execute_stepwise")
_warned = False
_announced = False  # the start-up line: once per process


def _warn_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "[XPU_COLLECTIVE_MEMORY] MiniMax-H3's VAE keeps the checkpoint's tile gather: %s (%s)",
            reason,
            running(),
        )


def _adapter_class(module: ModuleType) -> tuple[type | None, str | None]:
    adapter = getattr(module, "MiniMaxH3VideoVAE", None)
    if not isinstance(adapter, type):
        return None, f"{ADAPTER_MODULE} has no MiniMaxH3VideoVAE class"
    missing = [name for name in _EXPECTED_METHODS if not callable(getattr(adapter, name, None))]
    params = list(inspect.signature(adapter.__init__).parameters)
    if missing or params[:2] != ["self", "component_path"]:
        return None, f"MiniMaxH3VideoVAE has another shape (missing {missing}, __init__{tuple(params)})"
    return adapter, None


def hook_adapter(module: ModuleType) -> bool:
    """Make ``MiniMaxH3VideoVAE.__init__`` end with the install, once; returns whether it is hooked."""
    adapter, problem = _adapter_class(module)
    if adapter is None:
        _warn_once(problem)
        return False
    original = adapter.__init__
    if getattr(original, _HOOK_MARK, False):
        return True

    from vllm_omni.diffusion.models.minimax_h3 import vae_gather
    from vllm_omni.distributed import managed_distributed

    gathers, routes = vae_gather.reuse_mode() != "0", _staging_here()
    if not (gathers or routes):
        logger.info("[XPU_COLLECTIVE_MEMORY] %s=0 and staging off: MiniMax-H3's VAE is as released (%s)",
                    vae_gather.REUSE_ENV, running())  # fmt: skip
        return True

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # Not guarded: a checkpoint the fix cannot serve is logged and left alone inside, alike on every rank, but
        # a rank that fails on its own (a bad switch value, no memory for the 28 KiB header buffer) must not come
        # up with the checkpoint's gather while its peers run this one; its start-up fails instead.
        if gathers:
            vae_gather.install_tile_gather_reuse(self)
        if routes:
            managed_distributed.scope_remote_code(self.model)

    setattr(__init__, _HOOK_MARK, True)
    adapter.__init__ = __init__
    logger.info(
        "[XPU_COLLECTIVE_MEMORY] hooked %s.%s.__init__ to install the tile gather (%s)",
        adapter.__module__,
        adapter.__qualname__,
        running(),
    )
    check_overlay(logger)
    return True


def hook_worker(module: ModuleType) -> bool:
    """Make the diffusion worker do what upstream's does, once; returns whether it is hooked.

    Staging, ``init_device`` first hooks the request path (before the process groups exist) and it and
    ``load_model`` run plain collectives. With the request pool, ``init_device`` ends by making the worker's pool
    (after the device is set, before the model loads), each request entry point runs in it, ``sleep()`` releases it
    before its ``empty_cache()`` and ``wake_up()`` makes a new one. With neither, the worker is left as released.
    """
    worker = getattr(module, "DiffusionWorker", None)
    original = getattr(worker, "init_device", None) if isinstance(worker, type) else None
    if not callable(original):
        logger.warning("[XPU_COLLECTIVE_MEMORY] found no DiffusionWorker.init_device in %s", WORKER_MODULE)
        return False
    if getattr(original, _WORKER_MARK, False):
        return True

    from vllm_omni.distributed.persistent_collectives import SWITCH_ENV, switch_mode
    from vllm_omni.distributed.request_pool import POOL_ENV, pool_enabled

    if pool_enabled():
        _hook_the_pool(worker, original)
    elif _staging_here():
        _hook_staging(worker, original)
    else:
        logger.info(
            "[XPU_COLLECTIVE_MEMORY] off in this process (%s=%s on %s, %s unset): the diffusion worker and its "
            "collectives are as released (%s)",
            SWITCH_ENV, switch_mode(), _device_type(), POOL_ENV, running(),
        )  # fmt: skip
    return True


def _device_type() -> str:
    from vllm_omni.platforms import current_omni_platform

    return current_omni_platform.device_type


def _staging_here() -> bool:
    """Whether this process stages, by the switches and its platform's device, before anything is hooked (a release's
    platform has no ``collectives()`` of its own), importing none of staging's modules where it does not."""
    from vllm_omni.distributed.persistent_collectives import collectives_for

    return collectives_for(_device_type()).staged


def _hook_staging(worker: type, original) -> None:
    from vllm_omni.distributed.persistent_collectives import unstaged

    from . import request_path

    plain_init = unstaged()(original)  # start-up and model load run plain collectives: they keep no block
    serve_metrics.holding(lambda: (1.0, request_path.staged_stats(loading_too=True)["resident_bytes"]))
    serve_metrics.hook_runner(importlib.import_module(serve_metrics.RUNNER_MODULE))

    @functools.wraps(original)
    def init_device(self, *args, **kwargs):
        hook_request_path()  # before the process groups exist, so that every coordinator is registered
        return plain_init(self, *args, **kwargs)

    setattr(init_device, _WORKER_MARK, True)
    worker.init_device = init_device
    if callable(load_model := getattr(worker, "load_model", None)):
        worker.load_model = unstaged()(load_model)


def _hook_the_pool(worker: type, original) -> None:
    from vllm_omni.distributed.request_pool import open_request_pool

    @functools.wraps(original)
    def init_device(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        from vllm_omni.platforms import current_omni_platform

        self.request_pool = open_request_pool(current_omni_platform, self.device)
        serve_metrics.holding(functools.partial(_pool_bytes, self))
        logger.info("[XPU_COLLECTIVE_MEMORY] request memory pool: collectives are torch's own (%s)",
                    running())  # fmt: skip
        return result

    setattr(init_device, _WORKER_MARK, True)
    worker.init_device = init_device
    serve_metrics.hook_runner(importlib.import_module(serve_metrics.RUNNER_MODULE))
    for name in REQUEST_ENTRY_POINTS:
        if callable(entry := getattr(worker, name, None)):
            setattr(worker, name, _in_request_memory(entry))
    if callable(sleep := getattr(worker, "sleep", None)):
        worker.sleep = _releasing_the_pool(sleep)
    if callable(wake_up := getattr(worker, "wake_up", None)):
        worker.wake_up = _renewing_the_pool(wake_up)


def _pool_bytes(worker) -> tuple[float, int]:
    pool = getattr(worker, "request_pool", None)
    return 2.0, sum(segment["total_size"] for segment in pool.snapshot()) if pool is not None else 0


def hook_server(module: ModuleType) -> bool:
    """The API server's ``/metrics`` gets the workers' memory figure, where staging or the pool is on."""
    from vllm_omni.distributed.request_pool import pool_enabled

    if not (pool_enabled() or _staging_here()):
        return True  # off: the server as released
    return serve_metrics.hook_server(module)


def _in_request_memory(entry):
    from vllm_omni.distributed.request_pool import use_request_pool

    @functools.wraps(entry)
    def run_in_request_memory(self, *args, **kwargs):
        with use_request_pool(getattr(self, "request_pool", None)):
            return entry(self, *args, **kwargs)

    return run_in_request_memory


def _releasing_the_pool(sleep):
    @functools.wraps(sleep)
    def sleep_without_the_pool(self, *args, **kwargs):
        if (pool := getattr(self, "request_pool", None)) is not None:
            pool.release()  # its free segments are released with the cache that sleep() empties
        return sleep(self, *args, **kwargs)

    return sleep_without_the_pool


def _renewing_the_pool(wake_up):
    @functools.wraps(wake_up)
    def wake_up_with_a_pool(self, *args, **kwargs):
        woke = wake_up(self, *args, **kwargs)
        if (pool := getattr(self, "request_pool", None)) is not None:
            pool.renew()
        return woke

    return wake_up_with_a_pool


def hook_request_path() -> None:
    """In a diffusion worker: the coordinator, the platform and the request path's modules, now or when loaded."""
    global _request_path_hook
    from . import request_path  # imports vLLM-Omni's distributed modules: in diffusion workers only

    mode = request_path.persistent_collectives.switch_mode()
    if _request_path_hook is not None:
        return
    _request_path_hook = request_path.hook_for
    for name, module in list(sys.modules.items()):
        if module is not None and request_path.hook_for(name) is not None:  # imported before this worker started
            _hook_quietly(module)
    logger.info(
        "[XPU_COLLECTIVE_MEMORY] request path hooked in this diffusion worker (%s=%s, %s)",
        request_path.persistent_collectives.SWITCH_ENV,
        mode,
        running(),
    )


_HOOKS = {ADAPTER_MODULE: hook_adapter, WORKER_MODULE: hook_worker, serve_metrics.SERVER_MODULE: hook_server}
_request_path_hook = None  # in a diffusion worker: request_path.hook_for


def _hooks_of(name: str) -> list:
    own = _HOOKS.get(name)
    routed = _request_path_hook(name) if _request_path_hook is not None else None
    return [hook for hook in (own, routed) if hook is not None]


def _hook_quietly(module: ModuleType) -> None:
    try:
        for hook in _hooks_of(module.__name__):
            hook(module)
    except Exception:  # never into vLLM-Omni's own import or a worker's start-up
        logger.exception("[XPU_COLLECTIVE_MEMORY] could not hook %s; it is left as released", module.__name__)


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of a hooked module so its hook runs right after it."""

    def find_spec(self, fullname, path, target=None):
        if not _hooks_of(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            _hook_quietly(module)

        spec.loader.exec_module = exec_then_hook
        return spec


def register() -> None:
    """Hook the adapter and the diffusion worker now where their modules are loaded, else when first imported.

    Later calls are no-ops. A bad ``VLLM_OMNI_PERSISTENT_COLLECTIVES`` or block cap fails the process's start-up,
    alike on every rank, rather than leave one rank on other collectives than its peers.
    """
    from vllm_omni.distributed.persistent_collectives import SWITCH_ENV, block_cap, switch_mode
    from vllm_omni.distributed.request_pool import POOL_ENV, pool_enabled

    old_pool_switch()
    pool_enabled()
    mode = switch_mode()
    block_cap()
    global _announced
    if not _announced:
        _announced = True
        logger.info("[XPU_COLLECTIVE_MEMORY] loaded: %s (%s=%s, %s=%s)", running(), SWITCH_ENV, mode, POOL_ENV,
                    "1" if pool_enabled() else "0")  # fmt: skip
    for name in _HOOKS:
        if (module := sys.modules.get(name)) is not None:  # a spawned worker imports its module before the plugins
            _hook_quietly(module)
    if not any(isinstance(finder, _HookOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HookOnImport())


register_minimax_h3_vae_gather = old_entry_point("minimax_h3_vae_gather", register)
