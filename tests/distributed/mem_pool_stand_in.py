# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""A stand-in for ``torch.xpu``'s ``MemPool`` and ``use_mem_pool``, for CPU ranks: CPU has no caching allocator,
so nothing can route an allocation into a pool here. It proves where the pool is used, not where memory lands.
A test platform may hand it to served workers as its pool API (``mem_pool_api()``).

Its pool holds what a request makes: a tensor whose storage was not alive when the request began, unless it was
made in an earlier request. ``snapshot()`` gives that as segments, the address gaps between the storages alive
outside it, so the pool's user reads it as it reads the XPU allocator's. A storage made outside the pool while a
request runs (another thread) is taken for the pool's: the XPU allocator alone can tell.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading

import torch
from vllm.logger import init_logger

logger = init_logger("vllm_omni.mem_pool_stand_in")  # what a served worker did, for its test to read

_ids = itertools.count(1)
_END = 1 << 64


def _live_storages() -> dict[int, int]:
    """Every live CPU tensor's storage, by address: its size in bytes."""
    spans: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != "cpu":  # type(): no __class__ lookups
            continue
        try:
            storage = obj.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # a fake, meta or wrapper tensor: no memory of its own
            continue
        if address:
            spans[address] = max(spans.get(address, 0), nbytes)
    return spans


class MemPool:
    """One pool per construction, as ``torch.xpu.MemPool``; ``made`` counts them in this process."""

    made = 0

    def __init__(self, allocator=None, use_on_oom: bool = False) -> None:
        MemPool.made += 1
        self.id = (0, next(_ids))
        self.entries = 0
        self.depth = 0
        self.thread: int | None = None
        self.devices: list = []  # the device each entry named
        self.snapshots = 0  # walks of the pool's segments (the XPU allocator's take its lock)
        self._outside: dict[int, int] = {}
        self._own: set[int] = set()
        logger.info("[MEM_POOL_STAND_IN] MemPool %s made pid=%d (pools made: %d)", self.id, os.getpid(), MemPool.made)

    def snapshot(self) -> list[dict[str, int]]:
        self.snapshots += 1
        if not self.depth:
            return []
        segments, start = [], 0
        for address in sorted(self._outside):
            if address > start:
                segments.append({"address": start, "total_size": address - start})
            start = max(start, address + self._outside[address])
        segments.append({"address": start, "total_size": _END - start})
        return segments

    def _enter(self, device=None) -> None:
        self.devices.append(device)
        live = _live_storages()
        self._outside = {address: n for address, n in live.items() if address not in self._own}
        self.depth, self.entries, self.thread = self.depth + 1, self.entries + 1, threading.get_ident()
        logger.info("[MEM_POOL_STAND_IN] MemPool %s in use pid=%d (entry %d)", self.id, os.getpid(), self.entries)

    def _exit(self) -> None:
        self._own = {address for address in _live_storages() if address not in self._outside}
        self.depth -= 1


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device=None):
    pool._enter(device)
    try:
        yield
    finally:
        pool._exit()
