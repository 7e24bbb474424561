# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The registered ops through which compiled code reaches the platform's collectives where its process stages, and
the diffusion coordinator's all-reduce, all-gather and broadcast compiled. Dynamo traces torch's own collectives as
functional collectives into fresh outputs, which no staging sees; each op finds its group by name, as torch's
functional collectives do, and is never dead code, since every rank must run it.

Inductor orders its own collectives as the program calls them, but not ops it does not know, and reorders
independent nodes by memory: graphs that differ between ranks (split sizes are constants) could then hand the
backend their collectives in a different order on each rank and hang. So every op also declares that it mutates one
shared element, ``ORDER``: each depends on the one the program called before it, and no compiler may swap them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import request_collectives
from .request_collectives import as_gathered, gather_input, platform_collectives, source_rank

_R = dist.ReduceOp
REDUCE_OPS = {
    "sum": _R.SUM, "avg": _R.AVG, "product": _R.PRODUCT, "min": _R.MIN, "max": _R.MAX, "band": _R.BAND,
    "bor": _R.BOR, "bxor": _R.BXOR,
}  # fmt: skip

with torch.inference_mode(False):  # written by graphs compiled in and out of inference mode alike
    ORDER = torch.zeros(1)  # never read nor written: each op declares it mutated, which chains them in program order


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def reduce_name(op) -> str | None:
    """The op's name here, or None where it has none (then the call is torch's own, behind a graph break)."""
    return next((name for name, reduce in REDUCE_OPS.items() if op == reduce), None)


@torch.library.custom_op("vllm_omni::all_reduce", mutates_args=("tensor", "order"))
def _all_reduce(tensor: torch.Tensor, op: str, group_name: str, order: torch.Tensor) -> None:
    platform_collectives().all_reduce(tensor, _group(group_name), REDUCE_OPS[op])


@torch.library.custom_op("vllm_omni::broadcast", mutates_args=("tensor", "order"))
def _broadcast(tensor: torch.Tensor, src: int, group_name: str, order: torch.Tensor) -> None:
    platform_collectives().broadcast(tensor, src, _group(group_name))


@torch.library.custom_op("vllm_omni::all_gather", mutates_args=("order",))
def _all_gather(tensor: torch.Tensor, world_size: int, group_name: str, order: torch.Tensor) -> torch.Tensor:
    out = tensor.new_empty((world_size * tensor.shape[0], *tensor.shape[1:]))
    return platform_collectives().all_gather_into_tensor(out, tensor, _group(group_name))


_all_reduce.register_fake(lambda tensor, op, group_name, order: None)
_broadcast.register_fake(lambda tensor, src, group_name, order: None)
_all_gather.register_fake(lambda t, world, name, order: t.new_empty((world * t.shape[0], *t.shape[1:])))
for _op in (_all_reduce, _broadcast, _all_gather):
    torch.fx.node.has_side_effect(_op._opoverload)


def _in_place(op, tensor: torch.Tensor, *args) -> torch.Tensor:
    """``op`` on the tensor itself where it is contiguous, else on a row-major copy written back, as torch's traced
    collectives treat a strided tensor."""
    if tensor.is_contiguous():
        op(tensor, *args)
        return tensor
    staged = tensor.contiguous()
    op(staged, *args)
    return tensor.copy_(staged)


def all_reduce(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    return _in_place(torch.ops.vllm_omni.all_reduce, tensor, op, group_name(group), ORDER)


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    return _in_place(torch.ops.vllm_omni.broadcast, tensor, src, group_name(group), ORDER)


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along dim 0, in rank order."""
    world = dist.get_world_size(group)
    return torch.ops.vllm_omni.all_gather(tensor.contiguous(), world, group_name(group), ORDER)


# The diffusion coordinator's all-reduce, all-gather and broadcast where its process stages, compiled.
def coordinator_all_reduce(self, input_: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``GroupCoordinator.all_reduce``: in place where it can be; use the return value."""
    if self.world_size == 1:
        return input_
    if (name := reduce_name(op)) is None:  # staged eagerly, behind a graph break
        return request_collectives.coordinator_all_reduce(self, input_, op)
    return all_reduce(input_, name, self.device_group)


def coordinator_all_gather(self, input_: torch.Tensor, dim: int = 0, separate_tensors: bool = False, group=None):
    """``GroupCoordinator.all_gather``: ranks' tensors concatenated along ``dim``, or each rank's (any ``dim``)."""
    group = self.device_group if group is None else group
    if dist.get_world_size(group) == 1:
        return input_
    input_ = gather_input(input_, dim)
    return as_gathered(all_gather(input_, group), input_, dim, separate_tensors)


def coordinator_broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``GroupCoordinator.broadcast`` from the group's rank ``src``, in place."""
    source = source_rank(self, src)
    if self.world_size == 1:
        return input_
    return broadcast(input_, source, self.device_group)
