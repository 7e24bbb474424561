# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The pool premise check's logic, against a stand-in caching allocator (this machine has no card): one that keeps a
live private pool's segments as the XPU and CUDA allocators do, and one that releases them. The check must say the
premise holds for the first and not for the second; on a card it runs against the real allocator."""

from __future__ import annotations

import contextlib
import itertools
import weakref

import pytest
import torch

from benchmarks import pool_premise

pytestmark = [pytest.mark.core_model, pytest.mark.cpu]

MIB = 1 << 20


class _Block:
    def __init__(self, segment: list, nbytes: int) -> None:
        self.segment, self.nbytes = segment, nbytes


class StandInAllocator:
    """A caching allocator reduced to what the check observes: one segment per allocation, freed blocks cached in
    the pool they were made in, ``empty_cache()`` releasing the default pool's free segments (only while no pool
    context is active) and, where ``releases_pools``, a pool's too: the behaviour the request pool must not meet."""

    def __init__(self, capacity_mib: int = 4096, releases_pools: bool = False) -> None:
        self.device = torch.device("cpu")
        self.out_of_memory = torch.OutOfMemoryError
        self._capacity, self._releases_pools = capacity_mib * MIB, releases_pools
        self._addresses = itertools.count(1 << 32, 1 << 32)  # a released segment is never mapped again here
        self._segments: dict[object, list[list]] = {None: []}  # pool id -> [address, bytes, in use]
        self._current: object = None
        self._retries = 0
        allocator = self

        class MemPool:
            def __init__(self) -> None:
                self.id = object()
                allocator._segments[self.id] = []

            def snapshot(self) -> list[dict]:
                return [{"address": a, "total_size": n} for a, n, _ in allocator._segments[self.id]]

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            assert device == allocator.device, device  # the worker's pool names its device
            allocator._current = pool.id
            try:
                yield
            finally:
                allocator._current = None

        self.MemPool, self.use_mem_pool = MemPool, use_mem_pool

    def empty(self, nbytes: int) -> _Block:
        segments = self._segments[self._current]
        free = next((s for s in segments if not s[2] and s[1] >= nbytes), None)
        if free is None:
            if self._reserved() + nbytes > self._capacity:
                self._retries += 1
                self._release()
                if self._reserved() + nbytes > self._capacity:
                    raise torch.OutOfMemoryError("stand-in: out of memory")
            free = [next(self._addresses), nbytes, False]
            segments.append(free)
        free[2] = True
        block = _Block(free, nbytes)
        weakref.finalize(block, free.__setitem__, 2, False)
        return block

    def _release(self) -> None:
        for pool, segments in self._segments.items():
            if (pool is None and self._current is None) or (pool is not None and self._releases_pools):
                segments[:] = [s for s in segments if s[2]]

    def _reserved(self) -> int:
        return sum(n for segments in self._segments.values() for _, n, _ in segments)

    def empty_cache(self) -> None:
        self._release()

    def segments(self, pool) -> list[tuple[int, int]]:
        if pool is not None:
            return sorted((s["address"], s["total_size"]) for s in pool.snapshot())
        return sorted((address, nbytes) for address, nbytes, _ in self._segments[None])

    def reserved(self) -> int:
        return self._reserved()

    def retries(self) -> int:
        return self._retries

    def capacity(self) -> int:
        return self._capacity


def test_with_an_allocator_that_keeps_a_live_pools_segments_the_premise_holds():
    allocator = StandInAllocator()
    result = pool_premise.check(allocator, allocator, requests=3, mib=64, chunk_mib=512)
    assert result["holds"] and result["pool_segments_survived"] and not result["request_2_added_a_segment"]
    assert result["default_segments_left_after_empty_cache"] == [0, 0, 0]  # the contrast: released every time
    assert result["fill"]["out_of_memory"] and result["fill"]["retries"] > 0
    first = pool_premise.format_result(result, "cpu").splitlines()[0]
    assert first.startswith("pool premise on cpu: HOLDS (vllm-omni-xpu-collective-memory ")
    assert " on vllm-omni " in first


def test_with_an_allocator_that_releases_a_pools_segments_the_check_says_the_premise_fails():
    allocator = StandInAllocator(releases_pools=True)
    result = pool_premise.check(allocator, allocator, requests=3, mib=64, chunk_mib=512)
    assert not result["holds"] and not result["pool_segments_survived"]
    assert "DOES NOT HOLD" in pool_premise.format_result(result, "cpu")


def test_the_check_refuses_expandable_segments_as_the_worker_does(monkeypatch):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    allocator = StandInAllocator()
    with pytest.raises(ValueError, match="PYTORCH_ALLOC_CONF='expandable_segments:True' turns on expandable"):
        pool_premise.check(allocator, allocator)


def test_the_command_needs_a_device_and_at_least_two_requests():
    with pytest.raises(SystemExit):
        pool_premise.main([])
    with pytest.raises(SystemExit):
        pool_premise.main(["--device", "xpu", "--requests", "1"])
