# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The kinds diffusion modules call beyond the coordinator's three: reduce-scatter, all-to-all, point-to-point
batches and barrier, staged as ``persistent_collectives`` stages the coordinator's, eagerly and through registered
ops for compiled code (ordered by ``traced_collectives.ORDER``). Even all-to-alls of one shape go in chunks above
the cap; reduce-scatters, all-to-alls with split sizes and point-to-point batches go whole. Staged, these calls
share the coordinator's block of each group, and point-to-point batches in flight hold blocks of a pool of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .collective_workspaces import resolve_device, synchronize
from .persistent_collectives import (
    _NON_MEMBER,
    ALIGN,
    Collectives,
    StagingBlock,
    _control_groups,
    _per_device,
    _writable,
    _write,
    aligned,
    block_cap,
)
from .persistent_collectives import _PERSISTENT as _COORDINATORS
from .request_collectives import platform_collectives
from .traced_collectives import ORDER, REDUCE_OPS, _group, group_name


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


class ModuleCollectives(Collectives):
    """``Collectives`` with the kinds only diffusion modules call."""

    IN_USE = "persistent buffers in use for the diffusion modules' own calls too"
    WHOLE = (
        "float all-reduces on more than two ranks, reduce-scatters, all-to-alls with split sizes and point-to-point "
        "batches"
    )

    def __init__(self, persistent: bool, blocks_of: Collectives | None = None) -> None:
        super().__init__(persistent, blocks_of)
        self._batches: weakref.WeakKeyDictionary[Any, dict[torch.device, list]] = weakref.WeakKeyDictionary()

    def blocks(self) -> list[StagingBlock]:
        pools = [pool for by_device in list(self._batches.values()) for pool in by_device.values()]
        return super().blocks() + [block for pool in pools for block in pool]

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


_PLAIN = ModuleCollectives(persistent=False)
_PERSISTENT = ModuleCollectives(persistent=True, blocks_of=_COORDINATORS)  # one block per group for both


def module_collectives() -> ModuleCollectives:
    """The modules' collectives: staged where the platform's are, plain while a worker loads its model."""
    return _PERSISTENT if platform_collectives().staged else _PLAIN


@torch.library.custom_op("vllm_omni::reduce_scatter", mutates_args=("order",))
def _reduce_scatter(
    tensor: torch.Tensor, op: str, world_size: int, group_name: str, order: torch.Tensor
) -> torch.Tensor:
    out = tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))
    return module_collectives().reduce_scatter_tensor(out, tensor, _group(group_name), REDUCE_OPS[op])


@torch.library.custom_op("vllm_omni::all_to_all", mutates_args=("order",))
def _all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group_name: str,
    order: torch.Tensor,
) -> torch.Tensor:
    out = _all_to_all_output(tensor, output_split_sizes, input_split_sizes, group_name, order)
    return module_collectives().all_to_all_single(
        out, tensor, _group(group_name), output_split_sizes, input_split_sizes
    )


def _all_to_all_output(tensor, output_split_sizes, input_split_sizes, group_name, order):
    rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    return tensor.new_empty((rows, *tensor.shape[1:]))


_reduce_scatter.register_fake(lambda t, op, world, name, order: t.new_empty((t.shape[0] // world, *t.shape[1:])))
_all_to_all.register_fake(_all_to_all_output)
for _op in (_reduce_scatter, _all_to_all):
    torch.fx.node.has_side_effect(_op._opoverload)


def reduce_scatter(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    """Compiled: the reduction's ``1 / world`` share of dim 0 for this rank."""
    world = dist.get_world_size(group)
    return torch.ops.vllm_omni.reduce_scatter(tensor.contiguous(), op, world, group_name(group), ORDER)


def all_to_all(tensor: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    """Compiled: what each peer sends this rank, along dim 0."""
    splits = [None if s is None else list(s) for s in (output_split_sizes, input_split_sizes)]
    return torch.ops.vllm_omni.all_to_all(tensor.contiguous(), *splits, group_name(group), ORDER)
