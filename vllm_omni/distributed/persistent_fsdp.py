# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""FSDP2's parameter all-gather into persistent blocks, through its own extension point (``Comm.allocate``).

FSDP2 gathers in place into one flat output per unit and forward, and frees it by dropping the reference (it resizes
only the parameters it copies out to). Without explicit prefetch at most two units' outputs are alive at once: unit
k+1 is gathered before unit k's output is released, and unit k+2 only after. So every unit of the process shares
two blocks, each unit always the same one: at most two of the largest unit's gathers, resident, whatever the
model's depth.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as _fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from vllm.logger import init_logger

from .collective_workspaces import GrowOnlyBlock
from .persistent_collectives import aligned
from .request_collectives import platform_choice

logger = init_logger(__name__)

SLOTS = 2  # outputs alive at once without explicit prefetch


class SharedSlots:
    """``SLOTS`` blocks every unit of the process shares. A unit keeps the block it first got, so each block grows
    to its units' largest gather on the first forward and every later forward finds it at the same address,
    whatever the number, order and sizes of the units. A block is handed out again only once FSDP2 has dropped every
    reference to its last output, as the caching allocator would reuse that memory; with deeper prefetch than
    expected, an output gets memory of its own.
    """

    def __init__(self) -> None:
        self.blocks = [GrowOnlyBlock() for _ in range(SLOTS)]
        self._outputs: list[weakref.ref | None] = [None] * SLOTS
        self._next = 0

    def take(self, kept: int | None, size: Sequence[int], dtype: torch.dtype, device: torch.device):
        """An output of ``size`` and the slot it lies in (None: memory of its own), ``kept`` first where free."""
        order = [i % SLOTS for i in range(self._next, self._next + SLOTS)]
        free = [i for i in ([kept] if kept is not None else []) + order if not _alive(self._outputs[i])]
        if not free:
            return torch.empty(size, dtype=dtype, device=device), None
        index, nbytes = free[0], torch.Size(size).numel() * dtype.itemsize
        try:
            self.blocks[index].ensure(aligned(nbytes), device)
        except Exception:  # no memory for a block: this unit gathers into memory of its own
            return torch.empty(size, dtype=dtype, device=device), None
        output = self.blocks[index].block[:nbytes].view(dtype).view(size)  # not a cached view: its life is FSDP2's
        self._outputs[index], self._next = weakref.ref(output), index + 1
        return output, index


class PersistentAllGather(AllGather):
    """One unit's all-gather, its outputs in the slots every unit shares: the same slot on every forward."""

    def __init__(self, slots: SharedSlots) -> None:
        self._slots, self._slot = slots, None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        output, slot = self._slots.take(self._slot, size, dtype, device)
        self._slot = slot if self._slot is None else self._slot
        return output

    def __call__(self, output_tensor, input_tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _alive(output: weakref.ref | None) -> bool:
    return output is not None and output() is not None


_shared: SharedSlots | None = None


def fully_shard(module, **kwargs: Any):
    """``torch.distributed.fsdp.fully_shard`` whose all-gathers land in persistent blocks where staging is on."""
    global _shared
    sharded = _fully_shard(module, **kwargs)
    if platform_choice().staged:  # sharded while the model loads; gathered on every request
        _shared = _shared or SharedSlots()
        for unit in [sharded] if isinstance(sharded, FSDPModule) else sharded:
            try:
                unit.set_custom_all_gather(PersistentAllGather(_shared))
            except ValueError:  # parameter groups on several meshes (shard_placement_fn): FSDP2 takes no custom comm
                logger.warning_once(
                    "[PERSISTENT_COLLECTIVES] %s has FSDP2 parameter groups on several meshes; its all-gathers are "
                    "torch's own",
                    type(unit).__name__,
                )
    return sharded
