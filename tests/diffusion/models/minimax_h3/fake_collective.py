# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""An in-process stand-in for a process group: one thread per rank, and a recorder of what the collective sees.

It stands in for torch.distributed (and oneCCL) in single-process tests; the multi-rank tests use real gloo
groups. Each call records the storage (allocation) of its send and receive tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CollectiveCall:
    rank: int
    send_alloc: int
    recv_alloc: int
    nbytes: int


@dataclass
class ThreadWorld:
    size: int
    timeout_s: float = 20.0
    calls: list[CollectiveCall] = field(default_factory=list)
    fail_on_call: int | None = None  # inject: every rank raises in this (0-based) collective call

    def __post_init__(self) -> None:
        self._barrier = threading.Barrier(self.size, timeout=self.timeout_s)
        self._inputs: list[torch.Tensor | None] = [None] * self.size
        self._lock = threading.Lock()
        self._count = [0] * self.size

    def group(self, rank: int) -> FakeGroup:
        return FakeGroup(self, rank)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, group: FakeGroup) -> None:
        rank = group.rank()
        with self._lock:
            self.calls.append(
                CollectiveCall(
                    rank, inp.untyped_storage().data_ptr(), output.untyped_storage().data_ptr(), output.nbytes
                )
            )
            index = self._count[rank]
            self._count[rank] += 1
        if self.fail_on_call is not None and index == self.fail_on_call:
            raise RuntimeError(f"injected collective failure on rank {rank}, call {index}")
        self._inputs[rank] = inp.clone()
        self._barrier.wait()
        torch.cat([t.reshape(-1) for t in self._inputs], out=output.view(-1))
        self._barrier.wait()

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on one thread per rank; returns results, or re-raises the first rank's exception."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                errors[rank] = exc

        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout_s * 3)
            if thread.is_alive():
                raise TimeoutError("a rank thread did not finish")
        for exc in errors:
            if exc is not None:
                raise exc
        return results


@dataclass(frozen=True)
class FakeGroup:
    world: ThreadWorld
    _rank: int

    def size(self) -> int:
        return self.world.size

    def rank(self) -> int:
        return self._rank


def install_fake_collective(monkeypatch) -> None:
    """Route ``dist.all_gather_single`` for FakeGroups to their ThreadWorld."""
    real = dist.all_gather_single

    def dispatch(output, inp, group=None, async_op=False):
        if isinstance(group, FakeGroup):
            return group.world.all_gather_single(output, inp, group)
        return real(output, inp, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_gather_single", dispatch)
