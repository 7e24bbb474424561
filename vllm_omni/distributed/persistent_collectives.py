# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Collectives that hand the backend the same buffers on every request: oneCCL registers every buffer an XPU
collective is handed and keeps it, and after ``empty_cache()`` activations land at new addresses. Staged, a call
copies into a block kept per (group, device), runs in place there and copies out, as FSDP2's all-gather does.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

from .collective_workspaces import ALIGN, GrowOnlyBlock, aligned, resolve_device, synchronize

logger = init_logger(__name__)

SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"


def switch_mode() -> str:
    """``VLLM_OMNI_PERSISTENT_COLLECTIVES``: ``auto`` (default, XPU only), ``1`` (any device) or ``0``."""
    value = (raw := os.environ.get(SWITCH_ENV, "auto")).strip().lower()
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{SWITCH_ENV}={raw!r} is not valid; expected one of 'auto', '1' or '0'")
    return value


def _write(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy as a backend writes: outside autograd, into inference tensors too."""
    inference = destination.is_inference() and not torch.is_inference_mode_enabled()
    with torch.no_grad(), torch.inference_mode() if inference else contextlib.nullcontext():
        destination.copy_(source)


def _layout(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The caller's strides where its elements are dense (a backend reduces them in memory order), else row-major."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return tensor.stride()


class _StagedBatch:
    """The one work of a staged point-to-point batch: ``wait()`` waits for all of it, then copies receives out."""

    def __init__(self, works: list, finish) -> None:
        self._works, self._finish = works, finish

    @torch.compiler.disable  # eager, as the works it waits for
    def wait(self, *args: Any) -> bool:
        while self._works:
            self._works[0].wait(*args)
            self._works.pop(0)
        if self._finish is not None:
            self._finish, finish = None, self._finish
            finish()
        return True


class Collectives:
    """Synchronous collectives whose results land in the caller's tensors; ``persistent`` stages them in blocks.

    A rank that cannot get its block (no memory, or in use) runs the plain collective on its own tensors: the wire
    collective is the same, so its peers never notice. Each such collective is logged once.
    """

    def __init__(self, persistent: bool) -> None:
        self.staged = persistent
        self._blocks: weakref.WeakKeyDictionary[Any, dict[tuple, GrowOnlyBlock]] = weakref.WeakKeyDictionary()
        self.staged_calls = self.fallbacks = 0
        self._logged: set[str] = set()

    def blocks(self) -> list[GrowOnlyBlock]:
        return [block for by_key in list(self._blocks.values()) for block in by_key.values()]

    def stats(self) -> dict[str, int]:
        blocks, counts = self.blocks(), {"staged_calls": self.staged_calls, "fallbacks": self.fallbacks}
        resident = {"block_allocations": sum(b.allocs for b in blocks), "resident_bytes": sum(b.nbytes for b in blocks)}
        return {**counts, "blocks": len(blocks), **resident}

    @contextlib.contextmanager
    def _block(self, name: str, group: Any, device: torch.device, nbytes: int, role: str = "collective"):
        """This call's block, busy until the call is done; None where it runs on the caller's tensors."""
        if not self.staged:
            yield None
            return
        group = group if group is not None else dist.group.WORLD
        device = resolve_device(device)
        block = self._blocks.setdefault(group, {}).setdefault((device, role), GrowOnlyBlock())
        if block.busy and role == "p2p":  # a batch nobody waited (its caller raised): its peers posted their match
            with contextlib.suppress(Exception):  # its own error is its caller's, long gone
                block.batch.wait()
        problem = "its block is in use" if block.busy else None
        if problem is None:
            try:
                block.ensure(aligned(nbytes), device, group)
            except Exception as error:  # OutOfMemoryError on a device, RuntimeError on CPU: this rank goes plain
                problem = f"no block of {nbytes} bytes on {device}: {error}"
        if problem is not None:
            self.fallbacks += 1
            if name not in self._logged:
                self._logged.add(name)
                logger.warning(
                    "[PERSISTENT_COLLECTIVES] %s ran on the caller's tensors on this rank: %s", name, problem
                )
            yield None
            return
        if not self.staged_calls:
            logger.info("[PERSISTENT_COLLECTIVES] persistent buffers in use in this process (first: %s)", name)
        block.busy, self.staged_calls = True, self.staged_calls + 1
        try:
            yield block
        except BaseException:
            block.busy = False
            raise
        block.busy = role == "p2p"  # a batch's block stays busy until the batch is waited

    def all_reduce(self, tensor, group, op=dist.ReduceOp.SUM, out=None) -> torch.Tensor:
        result = tensor if out is None else out
        with self._block("all_reduce", group, tensor.device, tensor.nbytes) as block:
            staged = result if block is None else block.view(tensor.shape, tensor.dtype, strides=_layout(tensor))
            if staged is not tensor:
                _write(staged, tensor)
            dist.all_reduce(staged, op=op, group=group)
            if staged is not result:
                _write(result, staged)
        return result

    def all_gather_into_tensor(self, output, input, group) -> torch.Tensor:
        """``input`` and ``output`` contiguous; ``output`` holds every rank's ``input`` in rank order."""
        with self._block("all_gather_into_tensor", group, input.device, output.nbytes) as block:
            if block is None:
                dist.all_gather_single(output, input, group=group)
                return output
            gathered = block.view((output.numel(),), output.dtype)
            mine = gathered.narrow(0, dist.get_rank(group) * input.numel(), input.numel())
            _write(mine.view(input.shape), input)
            dist.all_gather_single(gathered, mine, group=group)  # in place: this rank's slot is the input
            _write(output, gathered.view(output.shape))
        return output

    def broadcast(self, tensor, src, group) -> torch.Tensor:
        """From global rank ``src``, in place."""
        with self._block("broadcast", group, tensor.device, tensor.nbytes) as block:
            staged = tensor if block is None else block.view(tensor.shape, tensor.dtype, strides=_layout(tensor))
            if staged is not tensor and dist.get_rank() == src:
                _write(staged, tensor)
            dist.broadcast(staged, src=src, group=group)
            if staged is not tensor and dist.get_rank() != src:
                _write(tensor, staged)
        return tensor

    def all_to_all_single(self, output, input, group, output_split_sizes=None, input_split_sizes=None):
        """``input`` and ``output`` contiguous, split along dim 0."""
        splits = (output_split_sizes, input_split_sizes)
        with self._block("all_to_all_single", group, input.device, aligned(input.nbytes) + output.nbytes) as block:
            if block is None:
                dist.all_to_all_single(output, input, *splits, group=group)
                return output
            sent = block.view(input.shape, input.dtype)
            received = block.view(output.shape, output.dtype, offset=aligned(input.nbytes))
            _write(sent, input)
            dist.all_to_all_single(received, sent, *splits, group=group)
            _write(output, received)
        return output

    def barrier(self, group, device) -> None:
        """Staged, an all-reduce of a persistent element and a device sync (XCCL's barrier makes a new element)."""
        if not self.staged:
            dist.barrier(group=group)
            return
        with self._block("barrier", group, device, ALIGN) as block:
            token = torch.zeros(1, dtype=torch.int32, device=device) if block is None else block.view((1,), torch.int32)
            token.zero_()
            dist.all_reduce(token, group=group)  # every rank, with a block or not, enters the same collective
            synchronize(resolve_device(device))

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list:
        """Staged, sends are copied in now and receives out when the batch is waited (one work for the batch)."""
        sizes = [aligned(op.tensor.nbytes) for op in ops]
        with self._block("batch_isend_irecv", ops[0].group, ops[0].tensor.device, sum(sizes), "p2p") as block:
            if block is None:
                return dist.batch_isend_irecv(ops)
            views = [block.view(op.tensor.shape, op.tensor.dtype, sum(sizes[:i])) for i, op in enumerate(ops)]
            receives = []
            for op, view in zip(ops, views, strict=True):
                if op.op in (dist.isend, dist.send):
                    _write(view, op.tensor)
                else:
                    receives.append((op.tensor, view))
            works = dist.batch_isend_irecv(
                [dist.P2POp(o.op, v, o.peer, o.group, o.tag) for o, v in zip(ops, views, strict=True)]
            )

        def finish() -> None:
            for tensor, view in receives:
                _write(tensor, view)
            block.busy = False

        block.batch = _StagedBatch(list(works), finish)
        return [block.batch]


_PLAIN, _PERSISTENT = Collectives(persistent=False), Collectives(persistent=True)


def collectives_for(device_type: str) -> Collectives:
    """The process's collectives for a platform of ``device_type``, as the switch says."""
    mode = switch_mode()
    return _PERSISTENT if mode == "1" or (mode == "auto" and device_type == "xpu") else _PLAIN


def platform_collectives() -> Collectives:
    """The current platform's choice; by the switch alone where the platform makes none."""
    from vllm_omni.platforms import current_omni_platform

    choose = getattr(current_omni_platform, "collectives", None)
    return choose() if callable(choose) else collectives_for(current_omni_platform.device_type)


# Each CPU group stands in for its device group's object collectives.
_cpu_twins: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register_coordinator(coordinator: Any) -> None:
    coordinator.collective_name = coordinator.device_group.group_name  # how the ops find its group
    _cpu_twins[coordinator.device_group] = _cpu_twins[coordinator.cpu_group] = coordinator.cpu_group
    if coordinator.world_size == dist.get_world_size():  # the default group spans the same ranks
        _cpu_twins.setdefault(dist.group.WORLD, coordinator.cpu_group)


def cpu_twin(group: Any) -> Any:
    """The gloo group over the same ranks as ``group`` (None: the default group), where one is known."""
    return _cpu_twins.get(group if group is not None else dist.group.WORLD)


def _device_group(group_name: str) -> Any:
    return dist.distributed_c10d._resolve_process_group(group_name)  # as torch's functional collectives do


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@torch.library.custom_op("vllm_omni::all_reduce", mutates_args=())
def _all_reduce_op(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = torch.empty_like(tensor)
    return platform_collectives().all_reduce(tensor, _device_group(group_name), _OPS[op], out=out)


@torch.library.custom_op("vllm_omni::all_gather", mutates_args=())
def _all_gather_op(tensor: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    out = tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))
    return platform_collectives().all_gather_into_tensor(out, tensor, _device_group(group_name))


@torch.library.custom_op("vllm_omni::all_to_all", mutates_args=())
def _all_to_all_op(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    out = torch.empty_like(tensor)
    return platform_collectives().all_to_all_single(out, tensor, _device_group(group_name))


_all_reduce_op.register_fake(lambda tensor, op, group_name: torch.empty_like(tensor))
_all_gather_op.register_fake(lambda t, world_size, group_name: t.new_empty((world_size * t.shape[0], *t.shape[1:])))
_all_to_all_op.register_fake(lambda tensor, group_name: torch.empty_like(tensor))
for _op in (_all_reduce_op, _all_gather_op, _all_to_all_op):
    torch.fx.node.has_side_effect(_op._opoverload)  # every rank runs it, used or not: never dead code


def coordinator_all_reduce(self, input_: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``GroupCoordinator.all_reduce``: in place where it can be; use the return value."""
    if self.world_size == 1:
        return input_
    if torch.compiler.is_compiling():
        for name, reduce in _OPS.items():
            if op == reduce and getattr(self, "collective_name", None) is not None:  # in place, as eager code
                return input_.copy_(torch.ops.vllm_omni.all_reduce(input_, name, self.collective_name))
        dist.all_reduce(input_, op=op, group=self.device_group)  # traced as torch traces it
        return input_
    return platform_collectives().all_reduce(input_, self.device_group, op)


def coordinator_all_gather(self, input_: torch.Tensor, dim: int = 0, separate_tensors: bool = False, group=None):
    """``GroupCoordinator.all_gather``: ranks' tensors concatenated along ``dim``, or one view per rank."""
    by_name = group is None and getattr(self, "collective_name", None) is not None
    group = self.device_group if group is None else group
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return input_
    if not -input_.dim() <= dim < input_.dim() or (separate_tensors and dim % input_.dim()):
        raise ValueError(f"dim={dim} for a tensor of shape {tuple(input_.shape)}: expected a dim of it, 0 if separate")
    input_ = input_.contiguous()
    if torch.compiler.is_compiling() and by_name:
        stacked = torch.ops.vllm_omni.all_gather(input_, world_size, self.collective_name)
    else:
        stacked = input_.new_empty((world_size * input_.shape[0], *input_.shape[1:]))
        if torch.compiler.is_compiling():
            dist.all_gather_into_tensor(stacked, input_, group=group)  # traced as torch traces it
        else:
            platform_collectives().all_gather_into_tensor(stacked, input_, group)
    parts = stacked.view(world_size, *input_.shape).unbind(0)
    if separate_tensors:
        return list(parts)
    return stacked if dim % input_.dim() == 0 else torch.cat(parts, dim=dim)


def coordinator_broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``GroupCoordinator.broadcast`` from the group's rank ``src``, in place."""
    if src >= self.world_size:
        raise ValueError(f"src={src}: expected a rank of this group, src < {self.world_size}")
    if self.world_size == 1:
        return input_
    return platform_collectives().broadcast(input_, self.ranks[src], self.device_group)
