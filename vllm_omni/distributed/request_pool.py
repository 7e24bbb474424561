# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Pool mode (``VLLM_OMNI_PERSISTENT_COLLECTIVES=pool``): a diffusion worker runs every request inside one private
memory pool that lives as long as the worker. ``empty_cache()`` and the allocator's retry after an out-of-memory
error release only the default pool and pools no longer alive, so what a request hands a collective sits in segments
the backend has seen before, and the collective needs no copy. Tensors from outside the pool are staged as usual.

One pool for all components: they run one after another, so the pool holds the largest working set, and what
offload frees in one component the next reuses inside the pool. Only the request's thread allocates in it.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

POOL_MODE = "pool"


def pool_api(platform: Any) -> Any:
    """The module whose ``MemPool`` and ``use_mem_pool`` serve ``platform``'s allocator (``torch.xpu`` on XPU);
    a platform may name its own with ``mem_pool_api()``. Refuses a torch that has none, naming its version."""
    own = getattr(platform, "mem_pool_api", None)
    api = own() if callable(own) else getattr(torch, platform.device_type, None)
    if not (callable(getattr(api, "MemPool", None)) and callable(getattr(api, "use_mem_pool", None))):
        raise RuntimeError(
            f"VLLM_OMNI_PERSISTENT_COLLECTIVES=pool needs torch.{platform.device_type}.MemPool and use_mem_pool, "
            f"which torch {torch.__version__} does not have (XPU has them from torch 2.11); use 'auto' or '1'"
        )
    return api


class RequestPool:
    """The worker's pool; ``holds`` tells the tensors carved from its segments from all others."""

    def __init__(self, api: Any) -> None:
        self._api, self._pool = api, api.MemPool()
        self._starts: list[int] = []  # the pool's segments as they last stood, sorted by address
        self._ends: list[int] = []
        self._depth = 0
        self.requests = 0

    @property
    def active(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def request(self):
        if self._depth:  # an entry point called from another: the outer one's pool is in use
            yield
            return
        with self._api.use_mem_pool(self._pool):
            self._depth, self.requests = 1, self.requests + 1
            try:
                yield
            finally:
                self._depth = 0

    def holds(self, tensor: torch.Tensor) -> bool:
        address = tensor.untyped_storage().data_ptr()
        return self._within(address) or (self._refresh() and self._within(address))

    def _within(self, address: int) -> bool:
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and address < self._ends[index]

    def _refresh(self) -> bool:
        """The pool's segments now: they only grow while the pool lives, so a cached one stays the pool's."""
        segments = sorted((s["address"], s["address"] + s["total_size"]) for s in self._pool.snapshot())
        self._starts, self._ends = [start for start, _ in segments], [end for _, end in segments]
        return True


_worker: RequestPool | None = None


def open_worker_pool(platform: Any) -> RequestPool:
    """This diffusion worker's pool, made once, after its device is set and before its model loads."""
    global _worker
    if _worker is None:
        _worker = RequestPool(pool_api(platform))
        logger.info("[PERSISTENT_COLLECTIVES] each request of this worker allocates in one private memory pool")
    return _worker


def worker_pool() -> RequestPool | None:
    return _worker


def request_memory() -> contextlib.AbstractContextManager:
    """Around a request's forward: its allocations in the worker's pool, where pool mode opened one."""
    return _worker.request() if _worker is not None else contextlib.nullcontext()


def holds_all(tensors: Any) -> bool:
    """Whether a request is running in the pool and every one of ``tensors`` is carved from it."""
    pool = _worker
    return pool is not None and pool.active and all(pool.holds(t) for t in tensors)
