# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Each request of a diffusion worker in one private memory pool (``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1``).

The worker makes the pool once its device is set and keeps it until it sleeps. ``empty_cache()`` and the allocator's
retry after an out-of-memory error release only the default pool and pools no longer alive, so what a request hands
a collective sits in segments the backend has seen before. Collectives stay torch's own: nothing is copied or routed.

One pool for all components: they run one after another, so the pool holds the largest working set, and what
offload frees in one component the next reuses inside the pool. Only the request's thread allocates in it, and a
freed block is reused only on the stream that made it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

POOL_ENV = "VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL"


def pool_enabled() -> bool:
    """``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL``: ``0`` (default) or ``1``."""
    raw = os.environ.get(POOL_ENV)
    value = "0" if raw is None else raw.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{POOL_ENV}={raw!r} is not valid; expected '0' or '1'")
    return value == "1"


def pool_api(platform: Any) -> Any:
    """The module whose ``MemPool`` and ``use_mem_pool`` serve ``platform``'s allocator (``torch.xpu`` on XPU);
    a platform may name its own with ``mem_pool_api()``. Refuses a torch that has none, naming its version."""
    own = getattr(platform, "mem_pool_api", None)
    api = own() if callable(own) else getattr(torch, platform.device_type, None)
    if not (callable(getattr(api, "MemPool", None)) and callable(getattr(api, "use_mem_pool", None))):
        raise RuntimeError(
            f"{POOL_ENV}=1 needs torch.{platform.device_type}.MemPool and use_mem_pool, which torch "
            f"{torch.__version__} does not have (XPU has them from torch 2.11); unset {POOL_ENV}"
        )
    return api


def refuse_expandable_segments(device_type: str, environ: Any = os.environ) -> None:
    """Pool mode needs segments that keep their memory: with expandable segments a pool is one reservation whose
    pages are unmapped and later mapped again at the same address onto other memory (a stale registration for
    oneCCL), and the allocator supports no IPC on them. Reads what ``device_type``'s allocator reads."""
    for name in ("PYTORCH_ALLOC_CONF", f"PYTORCH_{device_type.upper()}_ALLOC_CONF"):
        raw = environ.get(name, "")
        options = dict(item.partition(":")[::2] for item in raw.replace(" ", "").split(",") if item)
        if options.get("expandable_segments", "").lower() == "true":
            raise ValueError(
                f"{name}={raw!r} turns on expandable segments, which {POOL_ENV}=1 cannot use; remove "
                f"expandable_segments:True from {name}, or unset {POOL_ENV}"
            )


class RequestPool:
    """The worker's pool on its device, entered around each request; released while the worker sleeps."""

    def __init__(self, api: Any, device: torch.device) -> None:
        self._api, self.device, self._pool = api, device, api.MemPool()
        self._depth = 0
        self.requests = 0

    def release(self) -> None:
        """Drop the pool: a pool no longer alive is freeable, so the next ``empty_cache()`` frees its free segments
        (what a request made and still holds stays until it is freed)."""
        self._pool = None

    def renew(self) -> None:
        """A new pool after ``release()``, for the requests after a sleep."""
        if self._pool is None:
            self._pool = self._api.MemPool()

    @property
    def active(self) -> bool:
        return self._depth > 0

    def snapshot(self) -> list[dict[str, Any]]:
        """The pool's segments (``address``, ``total_size`` ...), as the allocator reports them: for diagnostics."""
        return [] if self._pool is None else self._pool.snapshot()

    @contextlib.contextmanager
    def request(self):
        if self._depth:  # an entry point called from another: the outer one's pool is in use
            yield
            return
        if self._pool is None:
            raise RuntimeError("a request while the worker's request pool is released (asleep); wake_up() renews it")
        # The device named: entered on another, the allocator would make a second pool there, freed at exit.
        with self._api.use_mem_pool(self._pool, device=self.device):
            self._depth, self.requests = 1, self.requests + 1
            try:
                yield
            finally:
                self._depth = 0


def open_request_pool(platform: Any, device: torch.device | str) -> RequestPool | None:
    """The worker's pool on its ``device`` where ``VLLM_OMNI_DIFFUSION_REQUEST_MEM_POOL=1``, else None. Made once the
    device is set, before the model loads; refuses, alike on every rank, what the pool cannot work with."""
    if not pool_enabled():
        return None
    device = torch.device(device)
    refuse_expandable_segments(device.type)
    api = pool_api(platform)
    if device.index is None and device.type != "cpu":
        device = torch.device(device.type, api.current_device())
    pool = RequestPool(api, device)
    logger.info("[REQUEST_POOL] each request of this worker allocates in one private memory pool (%s)", device)
    return pool


def use_request_pool(pool: RequestPool | None) -> contextlib.AbstractContextManager:
    """Around a request's forward: its allocations in ``pool``, where the worker has one."""
    return pool.request() if pool is not None else contextlib.nullcontext()
