# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives that hand the backend the same buffers on every request: oneCCL registers every buffer an XPU
collective is handed and keeps it, and after ``empty_cache()`` activations land at new addresses. Staged, a call
copies into a block kept per (group, device), runs in place there and copies out, as FSDP2's all-gather does.
A call larger than ``VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB`` goes through its block in chunks where
chunks keep the plain collective's bits (broadcasts, gathers, all-to-alls split evenly, integer reductions, float sums
on two ranks), as many on every rank. Float all-reduces on more than two ranks, reduce-scatters, all-to-alls with
split sizes and point-to-point batches go whole: their block holds the largest such call, at most twice over.
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

from .collective_workspaces import GrowOnlyBlock, resolve_device, synchronize
from .request_pool import POOL_ENV, pool_enabled

logger = init_logger(__name__)

SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"
CAP_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
DEFAULT_CAP_MIB = 64  # vLLM's symmetric-memory all-reduce stages up to 32-64 MiB
_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def switch_mode() -> str:
    """``VLLM_OMNI_PERSISTENT_COLLECTIVES``: ``auto`` (default: staged on XPU, unless each request runs in a private
    memory pool), ``1`` (staged on any device) or ``0``. Staging on top of the pool is refused: one of them is enough,
    and which is better is for cards to show."""
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
    """A block's next size: at least double what it held, within the cap for calls within it, so that a maximum
    that rises call after call leaves a few registrations behind, not one per call."""
    target = max(needed, 2 * held)
    return aligned(min(target, block_cap()) if needed <= block_cap() else target)


def current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now; None where there are no streams."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device.type).current_stream(device)


class StagingBlock(GrowOnlyBlock):
    """A grow-only block that calls stage through, one at a time: ``busy`` marks a collective still running on it
    (a caller that finds it busy uses its own tensors instead), ``stream`` the stream of its last use."""

    _MAX_VIEWS = 64  # views kept per block: a view costs more host time to build than most copies into it

    def __init__(self) -> None:
        super().__init__()
        self.busy = False
        self.stream: Any = None
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, shape, dtype: torch.dtype, offset: int = 0, strides: tuple[int, ...] | None = None) -> torch.Tensor:
        """A ``dtype`` view of ``shape`` at byte ``offset`` (a multiple of ``ALIGN``): row-major, or laid out
        densely with ``strides``. Never hand it to a caller: it aliases the block."""
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
        """Order a use on ``device``'s current stream after the last use, where that was on another stream: the last
        use's copies out are queued there, and this use writes the block."""
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
    """Whether staging writes ``output`` as the backend would: contiguous tensors alike, and no tensor autograd
    guards (backends refuse or accept those as they do). Anything else is torch's own call."""
    return (
        output.is_contiguous()
        and input.is_contiguous()
        and output.dtype == input.dtype
        and output.device == input.device
        and not output.requires_grad
    )


def _gathers_into(output: Any, input: torch.Tensor, world: int) -> bool:
    """A list of ``world`` tensors of the input's shape, or their concatenation along dim 0: what every backend
    gathers into (gloo refuses even a stack or a flat tensor of the same size)."""
    if isinstance(output, list):
        return len(output) == world and all(t.shape == input.shape and _writable(t, input) for t in output)
    whole = (world * input.shape[0], *input.shape[1:]) if input.dim() else (world,)
    return output.shape == whole and _writable(output, input)


def _splits_fit(output: torch.Tensor, input: torch.Tensor, output_splits: Any, input_splits: Any, world: int) -> bool:
    """Whether an all-to-all's tensors are split as every backend requires: each split list one size per rank
    summing to its tensor's dim 0, or none and a dim 0 that ranks share evenly, of equal sizes where neither has a
    list. The rest is torch's own, which refuses it as the backend does."""

    def fits(tensor: torch.Tensor, splits: Any) -> bool:
        if not tensor.dim():
            return False
        if splits is None:
            return tensor.shape[0] % world == 0
        return len(splits) == world and sum(splits) == tensor.shape[0]

    even = output_splits is not None or input_splits is not None or output.numel() == input.numel()
    return even and fits(output, output_splits) and fits(input, input_splits)


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
    """Whether reducing in chunks gives the whole reduction's bits: a backend's order of summation depends on the
    message size (gloo's ring, NCCL's channels), so only integers and floating-point sums of two ranks are safe."""
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return True
    return op == dist.ReduceOp.SUM and dist.get_world_size(group) == 2


class _StagedBatch(dist.Work):
    """The one work of a staged point-to-point batch. Its receives land in the caller's tensors when it is waited,
    or seen complete (``is_completed``, its future, or the next batch on its group)."""

    def __init__(self, works: list, receives: list[tuple[torch.Tensor, torch.Tensor]], block: StagingBlock) -> None:
        super().__init__()
        self._works, self._receives, self._block = works, receives, block

    def _land(self, received: bool = True) -> None:
        if self._block is not None:
            block, self._block = self._block, None
            try:
                for tensor, view in self._receives if received else ():
                    _write(tensor, view)
            finally:
                block.busy = False

    @torch.compiler.disable  # eager, as the works it waits for
    def wait(self, timeout: Any = None) -> bool:
        try:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
        except BaseException:
            self._land(received=False)  # the block is free again; what it held never reaches the caller
            raise
        self._land()
        return True

    synchronize = block_current_stream = wait  # as on a device backend; gloo's are no-ops

    def is_completed(self) -> bool:
        if not all(work.is_completed() for work in self._works):
            return False
        self._land()
        return True

    def exception(self) -> Any:
        return next((error for error in (work.exception() for work in self._works) if error is not None), None)

    def get_future(self) -> torch.futures.Future:
        landed = torch.futures.collect_all([work.get_future() for work in self._works])
        return landed.then(lambda _: (self._land(), [tensor for tensor, _ in self._receives])[1])


def finished_work(outputs: list[torch.Tensor]) -> dist.Work:
    """The work of a collective already run, for an ``async_op=True`` caller to wait on; its future holds
    ``outputs``, as a backend's does."""
    return _StagedBatch([], [(output, output) for output in outputs], None)


def _per_device(table: weakref.WeakKeyDictionary, group: Any) -> dict:
    """The group's entries of ``table``, by device (group None: the default group)."""
    group = group if group is not None else dist.group.WORLD
    by_device = table.get(group)
    if by_device is None:
        by_device = table[group] = {}
    return by_device


class Collectives:
    """Synchronous collectives whose results land in the caller's tensors; ``persistent`` stages them in blocks.

    A rank that cannot get its block (no memory, or in use) runs the same collectives on its own tensors: the wire
    collectives are the same, so its peers never notice. Each such collective is logged once.
    """

    def __init__(self, persistent: bool) -> None:
        self.staged = persistent
        self._blocks: weakref.WeakKeyDictionary[Any, dict[torch.device, StagingBlock]] = weakref.WeakKeyDictionary()
        self._batches: weakref.WeakKeyDictionary[Any, dict[torch.device, list]] = weakref.WeakKeyDictionary()
        self.staged_calls = self.chunked_calls = self.fallbacks = self.payload_bytes = self.staged_bytes = 0
        self._last: tuple[Any, torch.device, StagingBlock] | None = None  # the last lookup, most calls' next
        self._logged: set[str] = set()

    def blocks(self) -> list[StagingBlock]:
        singles = [b for by_device in list(self._blocks.values()) for b in by_device.values() if b is not None]
        pools = [pool for by_device in list(self._batches.values()) for pool in by_device.values()]
        return singles + [block for pool in pools for block in pool]

    def stats(self) -> dict[str, int]:
        blocks = self.blocks()
        counts = {"staged_calls": self.staged_calls, "chunked_calls": self.chunked_calls, "fallbacks": self.fallbacks}
        traffic = {"payload_bytes": self.payload_bytes, "staged_bytes": self.staged_bytes}
        resident = {"block_allocations": sum(b.allocs for b in blocks), "resident_bytes": sum(b.nbytes for b in blocks)}
        return {**counts, **traffic, "blocks": len(blocks), **resident, "block_cap_bytes": block_cap()}

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("[PERSISTENT_COLLECTIVES] %s", message % args)

    def _fall_back(self, name: str, problem: str) -> None:
        self.fallbacks += 1
        self._once(name, "%s ran on the caller's tensors on this rank: %s", name, problem)

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
        last = self._last
        if last is not None and last[0] is group and last[1] == device:
            return last[2]
        by_device = _per_device(self._blocks, group)
        if device not in by_device:
            by_device[device] = None if group in _control_groups else StagingBlock()
        block = by_device[device]
        self._last = (group, device, block)
        return block

    def _lease(self, name: str, block: StagingBlock, group: Any, device: torch.device, nbytes: int):
        if block.device != device or block.nbytes < nbytes:
            try:
                block.ensure(_grown(block.nbytes if block.device == device else 0, nbytes), device, group)
            except Exception as error:  # OutOfMemoryError on a device, RuntimeError on CPU: this rank goes plain
                return self._fall_back(name, f"no block of {nbytes} bytes on {device}: {error}")
        block.use_on(device)
        if not self.staged_calls:
            logger.info(
                "[PERSISTENT_COLLECTIVES] persistent buffers in use in this process (first: %s); blocks of at most "
                "%d MiB, but float all-reduces on more than two ranks, reduce-scatters, all-to-alls with split sizes "
                "and point-to-point batches go whole, in blocks of their size",
                name,
                block_cap() >> 20,
            )
        self.staged_calls += 1
        block.busy = True
        return block

    def _copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        _write(destination, source)
        self.staged_bytes += source.nbytes

    def _chunked(self, name: str, group: Any, tensor: torch.Tensor, run: Callable, copy_in: bool, copy_out: bool):
        """``run`` on consecutive pieces of ``tensor``'s elements, in memory order, staged through a block of at most
        the cap. How many pieces follows from the size and the cap alone, alike on every rank: a rank that cannot
        stage (a tensor autograd records, no block) runs the same pieces on its own memory, and a tensor with gaps on
        a row-major copy written back (a device backend refuses such a tensor whole; nothing outside it is
        touched)."""
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
        """In place, in the tensor's own memory order, as the backend reduces it. Whether it goes in pieces follows
        from its size, dtype and op alone, the same on every rank."""
        if group is _NON_MEMBER or not self.staged:
            dist.all_reduce(tensor, op=op, group=group)  # a gapped tensor fails or passes exactly as it would
            return tensor
        self.payload_bytes += tensor.nbytes
        if tensor.nbytes > block_cap():
            if _chunks_keep_bits(tensor, op, group):
                self._chunked("all_reduce", group, tensor, lambda part: dist.all_reduce(part, op, group), True, True)
                return tensor
            self._once("whole", "all_reduce of %d bytes is staged whole, above the %d-byte cap: chunks would change "
                       "its floating-point sums on more than two ranks", tensor.nbytes, block_cap())  # fmt: skip
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
        """Every rank's ``input`` in rank order into ``output``: one contiguous tensor, or a list of contiguous
        tensors, one per rank, each copied straight out of the block."""
        listed = isinstance(output, list)
        world = None if group is _NON_MEMBER else dist.get_world_size(group)
        plain = world is None or not input.numel() or not _gathers_into(output, input, world)
        if plain or not self.staged:
            dist.all_gather(output, input, group=group) if listed else dist.all_gather_single(
                output, input, group=group
            )
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

    def all_to_all_single(self, output, input, group, output_split_sizes=None, input_split_sizes=None):
        """Split along dim 0 as the splits say, or evenly; an even one of one shape goes in chunks above the cap."""
        splits = (output_split_sizes, input_split_sizes)
        plain = group is _NON_MEMBER or not _writable(output, input)
        plain = plain or not _splits_fit(output, input, *splits, dist.get_world_size(group))
        if plain or not self.staged:
            dist.all_to_all_single(output, input, *splits, group=group)
            return output
        self.payload_bytes += input.nbytes + output.nbytes
        world, size = dist.get_world_size(group), input.element_size()
        width = input.numel() // world  # elements per peer, where the splits are even
        step = min(width, block_cap() // (2 * world * size))
        if output_split_sizes is not None or input_split_sizes is not None or output.shape != input.shape:
            step = width  # staged whole, in the caller's shapes
        if step == width:
            return self._whole(
                "all_to_all_single",
                output,
                input,
                group,
                lambda o, i: dist.all_to_all_single(o, i, *splits, group=group),
            )
        rows_in, rows_out = input.view(world, width), output.view(world, width)
        block = self._acquire("all_to_all_single", group, input.device, 2 * aligned(world * step * size))
        try:
            for start in range(0, width, step):
                part = min(step, width - start)
                if block is None:
                    sent, received = input.new_empty((world, part)), input.new_empty((world, part))
                else:
                    sent = block.view((world, part), input.dtype)
                    received = block.view((world, part), input.dtype, aligned(world * step * size))
                self._copy(sent, rows_in[:, start : start + part])
                dist.all_to_all_single(received, sent, group=group)
                self._copy(rows_out[:, start : start + part], received)
        finally:
            if block is not None:
                block.busy = False
        self.chunked_calls += 1
        return output

    def _whole(self, name: str, output: torch.Tensor, input: torch.Tensor, group: Any, run: Callable):
        """``run(output, input)`` out of place on the two staged in one block."""
        block = self._acquire(name, group, input.device, aligned(input.nbytes) + output.nbytes)
        if block is None:
            run(output, input)
            return output
        try:
            sent = block.view(input.shape, input.dtype)
            received = block.view(output.shape, output.dtype, aligned(input.nbytes))
            self._copy(sent, input)
            run(received, sent)
            self._copy(output, received)
        finally:
            block.busy = False
        return output

    def reduce_scatter_tensor(self, output, input, group, op=dist.ReduceOp.SUM):
        """Contiguous tensors; staged whole, as chunks would change a floating-point sum's bits."""
        if group is _NON_MEMBER or not _writable(output, input) or not self.staged:
            dist.reduce_scatter_tensor(output, input, op=op, group=group)
            return output
        self.payload_bytes += input.nbytes
        run = lambda o, i: dist.reduce_scatter_tensor(o, i, op=op, group=group)  # noqa: E731
        return self._whole("reduce_scatter_tensor", output, input, group, run)

    def barrier(self, group: Any, device: torch.device) -> None:
        """Staged, an all-reduce of a persistent element and a device sync (XCCL's barrier makes a new element)."""
        if group is _NON_MEMBER or not self.staged:
            dist.barrier(group=group)
            return
        block = self._acquire("barrier", group, device, ALIGN)
        try:
            token = torch.zeros(1, dtype=torch.int32, device=device) if block is None else block.view((1,), torch.int32)
            token.zero_()
            dist.all_reduce(token, group=group)  # every rank, with a block or not, enters the same collective
        finally:
            if block is not None:
                block.busy = False
        synchronize(resolve_device(device))

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list:
        """Staged, sends are copied in now and receives out when the batch lands; batches in flight each hold a
        block of their group's pool until then, and are posted at once, as torch posts them."""
        group, device = ops[0].group, ops[0].tensor.device
        guarded = any(op.tensor.requires_grad for op in ops if op.op not in (dist.isend, dist.send))
        plain = group is _NON_MEMBER or group in _control_groups or guarded
        if plain or not self.staged:
            return dist.batch_isend_irecv(ops)
        sizes = [aligned(op.tensor.nbytes) for op in ops]
        block = self._batch_block(group, device, sum(sizes))
        if block is None:
            return dist.batch_isend_irecv(ops)
        try:
            views = [block.view(op.tensor.shape, op.tensor.dtype, sum(sizes[:i])) for i, op in enumerate(ops)]
            receives = []
            for op, view in zip(ops, views, strict=True):
                self.payload_bytes += op.tensor.nbytes
                if op.op in (dist.isend, dist.send):
                    self._copy(view, op.tensor)
                else:
                    receives.append((op.tensor, view))
                    self.staged_bytes += op.tensor.nbytes  # copied out when it lands
            works = dist.batch_isend_irecv(
                [dist.P2POp(o.op, v, o.peer, o.group, o.tag) for o, v in zip(ops, views, strict=True)]
            )
        except BaseException:
            block.busy = False
            raise
        block.batch = _StagedBatch(list(works), receives, block)
        return [block.batch]

    def _batch_block(self, group: Any, device: torch.device, nbytes: int) -> StagingBlock | None:
        """The first free block of the group's pool, which grows by one where none is: waiting for a batch here
        could wait for one its peers post only after this one. A batch complete but never waited lands first."""
        pool = _per_device(self._batches, group).setdefault(device, [])
        free = next((b for b in pool if not b.busy or b.batch.is_completed()), None)
        if free is None:
            free = StagingBlock()
            pool.append(free)
        return self._lease("batch_isend_irecv", free, group, device, nbytes)


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


def unless_loading(choice: Collectives) -> Collectives:
    """``choice``, or plain collectives inside ``unstaged()``."""
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


def cpu_twin(group: Any) -> Any:
    """The gloo group over the same ranks as ``group`` (None: the default group), where one is known."""
    return _cpu_twins.get(group if group is not None else dist.group.WORLD)
