# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives that hand the backend the same buffers on every request: oneCCL registers every buffer an XPU
collective is handed and keeps it, and after ``empty_cache()`` activations land at new addresses. Staged, a call
copies into a block kept per (group, device), runs in place there and copies out, as FSDP2's all-gather does.
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

from .collective_workspaces import GrowOnlyBlock, resolve_device
from .request_pool import POOL_ENV, pool_enabled

logger = init_logger(__name__)

SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"
CAP_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
DEFAULT_CAP_MIB = 64  # vLLM's symmetric-memory all-reduce stages up to 32-64 MiB
_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def switch_mode() -> str:
    """``auto`` (default: staged on XPU, unless each request runs in a private memory pool), ``1`` or ``0``; ``1``
    on top of the pool is refused: one of them is enough."""
    value = (raw := os.environ.get(SWITCH_ENV, "auto")).strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{SWITCH_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    if value == "1" and pool_enabled():
        raise ValueError(
            f"{SWITCH_ENV}=1 and {POOL_ENV}=1 each keep collective buffers in place; set one of them, not both"
        )
    return value


def parse_block_cap(raw: str | None) -> int:
    text = str(DEFAULT_CAP_MIB) if raw is None else raw.strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise ValueError(f"{CAP_ENV}={raw!r} is not valid; expected a whole number of MiB, at least 1")
    return int(text) << 20


_cap: int | None = None


def block_cap() -> int:
    """Bytes a block holds at most where chunks keep the bits: read once per process; set it alike on every rank."""
    global _cap
    if _cap is None:
        _cap = parse_block_cap(os.environ.get(CAP_ENV))
    return _cap


ALIGN = 512  # oneCCL's preferred alignment, and a multiple of every dtype's size


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _grown(held: int, needed: int) -> int:
    """At least double what a block held (within the cap for calls within it): a rising maximum leaves few blocks."""
    target = max(needed, 2 * held)
    return aligned(min(target, block_cap()) if needed <= block_cap() else target)


def current_stream(device: torch.device) -> Any:  # None where there are no streams
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device.type).current_stream(device)


class StagingBlock(GrowOnlyBlock):
    """A grow-only block calls stage through, one at a time (``busy``), ordered on ``stream``, that of its last use."""

    _MAX_VIEWS = 64  # views kept per block: a view costs more host time to build than most copies into it

    def __init__(self) -> None:
        super().__init__()
        self.busy = False
        self.stream: Any = None
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, shape, dtype: torch.dtype, offset: int = 0, strides: tuple[int, ...] | None = None) -> torch.Tensor:
        """A view at byte ``offset``, row-major or dense as ``strides``; never a caller's: it aliases the block."""
        key = (shape, dtype, offset, strides)
        view = self._views.get(key)
        if view is None:
            numel = torch.Size(shape).numel()
            with torch.inference_mode(False):  # kept: written later in and out of inference mode alike
                flat = self.block[offset : offset + numel * dtype.itemsize].view(dtype)
                view = flat.view(shape) if strides is None else flat.as_strided(shape, strides)
            if len(self._views) >= self._MAX_VIEWS:
                self._views.clear()
            self._views[key] = view
        return view

    def use_on(self, device: torch.device) -> None:
        """Order a use on another stream than the last after that one: its copies out are queued there."""
        stream = current_stream(device)
        if stream is not None:
            if self.stream is not None and stream != self.stream:
                stream.wait_stream(self.stream)
            self.stream = stream

    def drop(self) -> None:
        super().drop()
        self.stream = None
        self._views.clear()


def _write(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy as a backend writes: outside autograd, into inference tensors too."""
    if not (destination.requires_grad or source.requires_grad) and (
        torch.is_inference_mode_enabled() or not destination.is_inference()
    ):
        destination.copy_(source)  # nothing for autograd to record: the common case, without context managers
        return
    inference = destination.is_inference() and not torch.is_inference_mode_enabled()
    with torch.no_grad(), torch.inference_mode() if inference else contextlib.nullcontext():
        destination.copy_(source)


def _writable(output: torch.Tensor, input: torch.Tensor) -> bool:
    """Contiguous tensors alike, no output autograd guards: anything else is torch's own, as the backend takes it."""
    alike = output.dtype == input.dtype and output.device == input.device
    return alike and output.is_contiguous() and input.is_contiguous() and not output.requires_grad


def _gathers_into(output: Any, input: torch.Tensor, world: int) -> bool:
    """``world`` tensors of the input's shape, or their concatenation along dim 0, as every backend gathers into."""
    if isinstance(output, list):  # of any layout: each is written from a row-major gather
        alike = (t.shape == input.shape and t.dtype == input.dtype and t.device == input.device for t in output)
        guarded = any(t.requires_grad for t in output)
        return len(output) == world and input.is_contiguous() and all(alike) and not guarded
    whole = (world * input.shape[0], *input.shape[1:]) if input.dim() else (world,)
    return output.shape == whole and _writable(output, input)


def _layout(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The caller's strides where its elements are dense (a backend reduces them in memory order), else None."""
    if tensor.is_contiguous():
        return tensor.stride()
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return tensor.stride()


def _chunks_keep_bits(tensor: torch.Tensor, op: Any, group: Any) -> bool:
    """Only integers and float sums of two ranks: a backend's order of summation depends on the message size."""
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return True
    return op == dist.ReduceOp.SUM and dist.get_world_size(group) == 2


def _per_device(table: weakref.WeakKeyDictionary, group: Any) -> dict:  # by device; group None: the default
    return table.setdefault(group if group is not None else dist.group.WORLD, {})


class Collectives:
    """Synchronous collectives whose results land in the caller's tensors; ``persistent`` stages them in blocks.

    A rank that cannot get its block (no memory, or in use) runs the same collectives on its own tensors: the wire
    collectives are the same, so its peers never notice. Each such collective is logged once.
    """

    IN_USE, WHOLE = "persistent buffers in use in this process", "float all-reduces on more than two ranks"
    announced = False  # the first staged call of the class logs IN_USE, and what goes whole above the cap

    def __init__(self, persistent: bool, blocks_of: Collectives | None = None) -> None:
        self.staged = persistent  # and with ``blocks_of``, one block per (group, device) for both instances
        self._blocks = weakref.WeakKeyDictionary() if blocks_of is None else blocks_of._blocks
        self.staged_calls = self.chunked_calls = self.fallbacks = self.payload_bytes = self.staged_bytes = 0
        self._logged: set[str] = set()

    def blocks(self) -> list[StagingBlock]:
        return [b for by_device in list(self._blocks.values()) for b in by_device.values() if b is not None]

    def stats(self) -> dict[str, int]:
        blocks = self.blocks()
        counts = {"staged_calls": self.staged_calls, "chunked_calls": self.chunked_calls, "fallbacks": self.fallbacks}
        traffic = {"payload_bytes": self.payload_bytes, "staged_bytes": self.staged_bytes}
        resident = {"block_allocations": sum(b.allocs for b in blocks), "resident_bytes": sum(b.nbytes for b in blocks)}
        return {**counts, **traffic, "blocks": len(blocks), **resident, "block_cap_bytes": block_cap()}

    def _fall_back(self, name: str, problem: str) -> None:
        self.fallbacks += 1
        if name not in self._logged:  # once per kind
            self._logged.add(name)
            logger.warning("[PERSISTENT_COLLECTIVES] %s ran on the caller's tensors on this rank: %s", name, problem)

    def _acquire(self, name: str, group: Any, device: torch.device, nbytes: int) -> StagingBlock | None:
        """The call's block, busy until the caller frees it; None where the call runs on the caller's tensors."""
        if device.index is None and device.type not in ("cpu", "meta"):
            device = resolve_device(device)
        block = self._lookup(group, device)
        if block is None:  # a control group: its tensors never reach the device backend
            return None
        if block.busy:
            return self._fall_back(name, "its block is in use")
        return self._lease(name, block, group, device, nbytes)

    def _lookup(self, group: Any, device: torch.device) -> StagingBlock | None:
        by_device = _per_device(self._blocks, group)
        if device not in by_device:
            by_device[device] = None if group in _control_groups else StagingBlock()
        return by_device[device]

    def _lease(self, name: str, block: StagingBlock, group: Any, device: torch.device, nbytes: int):
        if block.device != device or block.nbytes < nbytes:
            try:
                block.ensure(_grown(block.nbytes if block.device == device else 0, nbytes), device, group)
            except Exception as error:  # OutOfMemoryError on a device, RuntimeError on CPU: this rank goes plain
                return self._fall_back(name, f"no block of {nbytes} bytes on {device}: {error}")
        block.use_on(device)
        if not type(self).announced:
            type(self).announced = True
            logger.info("[PERSISTENT_COLLECTIVES] %s (first: %s); blocks of at most %d MiB, but %s go whole",
                        self.IN_USE, name, block_cap() >> 20, self.WHOLE)  # fmt: skip
        self.staged_calls += 1
        block.busy = True
        return block

    def _copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        _write(destination, source)
        self.staged_bytes += source.nbytes

    def _chunked(self, name: str, group: Any, tensor: torch.Tensor, run: Callable, copy_in: bool, copy_out: bool):
        """``run`` on pieces of ``tensor``'s elements in memory order, through a block of at most the cap. How many
        follows from the size alone, alike on every rank: a rank that cannot stage (a tensor autograd records, no
        block) runs the same pieces on its own memory, a tensor with gaps on a row-major copy written back."""
        own = tensor.detach()
        if _layout(own) is None:
            own = own.contiguous()
        flat = own.as_strided((own.numel(),), (1,))  # dense: its storage span, in memory order
        step = block_cap() // flat.element_size()
        block = None
        if not tensor.requires_grad:
            block = self._acquire(name, group, flat.device, min(step, flat.numel()) * flat.element_size())
        try:
            for start in range(0, flat.numel(), step):
                part = flat[start : start + step]
                staged = part if block is None else block.view((part.numel(),), flat.dtype)
                if staged is not part and copy_in:
                    self._copy(staged, part)
                run(staged)
                if staged is not part and copy_out:
                    self._copy(part, staged)
        finally:
            if block is not None:
                block.busy = False
        if copy_out and own.data_ptr() != tensor.data_ptr():
            _write(tensor, own)
        self.chunked_calls += flat.numel() > step

    def all_reduce(self, tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place, in the tensor's memory order; in pieces or not by its size, dtype and op, alike on every rank."""
        if group is _NON_MEMBER or not self.staged:
            dist.all_reduce(tensor, op=op, group=group)  # a gapped tensor fails or passes exactly as it would
            return tensor
        self.payload_bytes += tensor.nbytes
        if tensor.nbytes > block_cap() and _chunks_keep_bits(tensor, op, group):
            self._chunked("all_reduce", group, tensor, lambda part: dist.all_reduce(part, op, group), True, True)
            return tensor
        strides = None if tensor.requires_grad else _layout(tensor)
        block = None if strides is None else self._acquire("all_reduce", group, tensor.device, tensor.nbytes)
        if block is None:
            dist.all_reduce(tensor, op=op, group=group)
            return tensor
        try:
            staged = block.view(tensor.shape, tensor.dtype, strides=strides)
            self._copy(staged, tensor)
            dist.all_reduce(staged, op=op, group=group)
            self._copy(tensor, staged)
        finally:
            block.busy = False
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        """From global rank ``src``, in place; in pieces of at most the cap, as many on every rank."""
        if group is _NON_MEMBER or not tensor.numel() or not self.staged:
            dist.broadcast(tensor, src=src, group=group)
            return tensor
        self.payload_bytes += tensor.nbytes
        mine = dist.get_rank() == src
        self._chunked("broadcast", group, tensor, lambda part: dist.broadcast(part, src, group), mine, not mine)
        return tensor

    def all_gather_into_tensor(self, output: Any, input: torch.Tensor, group: Any) -> Any:
        """Every rank's ``input`` in rank order into ``output``: a contiguous tensor, or a list of one per rank."""
        listed = isinstance(output, list)
        world = None if group is _NON_MEMBER else dist.get_world_size(group)
        plain = world is None or not input.numel() or not _gathers_into(output, input, world)
        if plain or not self.staged:
            (dist.all_gather if listed else dist.all_gather_single)(output, input, group=group)
            return output
        if listed and not all(t.is_contiguous() for t in output):  # gathered row-major, then written out
            stacked = self.all_gather_into_tensor(input.new_empty(world * input.numel()), input.view(-1), group)
            for row, part in zip(output, stacked.view(world, *input.shape), strict=True):
                _write(row, part)
            return output
        rank, numel, size = dist.get_rank(group), input.numel(), input.element_size()
        self.payload_bytes += world * input.nbytes
        step = max(1, min(numel, block_cap() // (world * size)))  # elements per rank and chunk
        flat, rows = input.view(-1), [t.view(-1) for t in output] if listed else output.view(world, numel)
        block = self._acquire("all_gather_into_tensor", group, input.device, world * step * size)
        if block is None and step == numel and not listed:
            dist.all_gather_single(output, input, group=group)
            return output
        try:
            for start in range(0, numel, step):
                width = min(step, numel - start)
                gathered = block.view((world * width,), input.dtype) if block else input.new_empty(world * width)
                slot = gathered.narrow(0, rank * width, width)
                self._copy(slot, flat[start : start + width])
                dist.all_gather_single(gathered, slot, group=group)  # in place: this rank's slot is the input
                parts = gathered.view(world, width)
                if listed:
                    for row, part in zip(rows, parts, strict=True):
                        self._copy(row[start : start + width], part)
                else:
                    self._copy(rows[:, start : start + width], parts)
        finally:
            if block is not None:
                block.busy = False
        self.chunked_calls += numel > step
        return output


_PLAIN, _PERSISTENT = Collectives(persistent=False), Collectives(persistent=True)
_choices: dict[tuple[str | None, str | None, str], Collectives] = {}


def collectives_for(device_type: str) -> Collectives:
    """The process's collectives for a platform of ``device_type``, as the switches say (the pool: torch's own)."""
    key = (os.environ.get(SWITCH_ENV), os.environ.get(POOL_ENV), device_type)
    choice = _choices.get(key)
    if choice is None:
        mode = switch_mode()
        staged = mode == "1" or (mode == "auto" and device_type == "xpu" and not pool_enabled())
        choice = _choices[key] = _PERSISTENT if staged else _PLAIN
        if choice.staged:
            block_cap()  # a bad cap is an error where it would be used, before the first collective
    return choice


_loading = False


@contextlib.contextmanager
def unstaged():
    """Plain collectives while a worker loads its model: a one-off weight broadcast keeps no block of its size."""
    global _loading
    before, _loading = _loading, True
    try:
        yield
    finally:
        _loading = before


def unless_loading(choice: Collectives) -> Collectives:  # plain inside ``unstaged()``
    return _PLAIN if _loading else choice


# Each CPU group stands in for its device group's object collectives; its own calls are control, never staged.
_cpu_twins: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_control_groups: weakref.WeakSet = weakref.WeakSet()


def register_coordinator(coordinator: Any) -> None:
    switch_mode()  # a bad switch stops start-up here, on every rank alike, and a bad cap where the process stages
    collectives_for(coordinator.device.type)
    _cpu_twins[coordinator.device_group] = _cpu_twins[coordinator.cpu_group] = coordinator.cpu_group
    if coordinator.cpu_group is not coordinator.device_group:
        _control_groups.add(coordinator.cpu_group)
    if coordinator.world_size == dist.get_world_size():  # the default group spans the same ranks
        _cpu_twins.setdefault(dist.group.WORLD, coordinator.cpu_group)


def cpu_twin(group: Any) -> Any:  # the gloo group over the same ranks, where one is known
    return _cpu_twins.get(group if group is not None else dist.group.WORLD)
