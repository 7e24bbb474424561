# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The platform's collectives as the request path reaches them: this process's choice (``staging()``, fixed for its
life, and ``platform_collectives()``), the registered ops through which compiled code reaches them where it stages,
and the diffusion coordinator's staged methods. Dynamo traces torch's own collectives as functional collectives into
fresh outputs, which no staging sees; each op finds its group by name, as torch's functional collectives do, and is
never dead code, since every rank must run it.

Inductor orders its own collectives as the program calls them, but not ops it does not know, and reorders
independent nodes by memory: graphs that differ between ranks (split sizes are constants) could then hand the
backend their collectives in a different order on each rank and hang. So every op also writes one shared element,
``ORDER``: each depends on the one the program called before it, and no compiler may swap them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from vllm_omni.platforms import current_omni_platform

from .persistent_collectives import Collectives, collectives_for, unless_loading

_choose: Callable[[], Collectives] | None = None


def platform_choice() -> Collectives:
    """The current platform's collectives, also while a worker loads (for what is set up then and staged later); by
    the switch alone on a release whose platform has no ``collectives()``."""
    global _choose
    if _choose is None:
        choose = getattr(type(current_omni_platform), "collectives", None)  # the class: no fallback to torch.<device>
        _choose = choose if callable(choose) else lambda: collectives_for(current_omni_platform.device_type)
    return _choose()


def platform_collectives() -> Collectives:
    """The current platform's collectives; plain while a worker loads its model."""
    return unless_loading(platform_choice())


@torch.compiler.assume_constant_result
def staging() -> bool:
    """Whether this process stages: fixed for its life, so compiled code reads it as a constant. Where it does not,
    every call site runs torch's own collective, eager and compiled, as upstream's code does."""
    return platform_choice().staged


_R = dist.ReduceOp
REDUCE_OPS = {
    "sum": _R.SUM, "avg": _R.AVG, "product": _R.PRODUCT, "min": _R.MIN, "max": _R.MAX, "band": _R.BAND,
    "bor": _R.BOR, "bxor": _R.BXOR,
}  # fmt: skip

with torch.inference_mode(False):  # written by graphs compiled in and out of inference mode alike
    ORDER = torch.zeros(1)  # never read: its writes chain the ops in program order


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def reduce_name(op) -> str | None:
    """The op's name here, or None where it has none (then the call is torch's own, behind a graph break)."""
    return next((name for name, reduce in REDUCE_OPS.items() if op == reduce), None)


def torchs_own(call, *args, **kwargs):
    """``call``, a collective of torch's own. Compiled, it runs behind a graph break: Inductor would order it among
    its own collectives but not against these ops, so the ranks could hand them to the backend in different orders."""
    if torch.compiler.is_compiling():
        return _eagerly(call, *args, **kwargs)
    return call(*args, **kwargs)


@torch.compiler.disable
def _eagerly(call, *args, **kwargs):
    return call(*args, **kwargs)


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


@torch.library.custom_op("vllm_omni::reduce_scatter", mutates_args=("order",))
def _reduce_scatter(
    tensor: torch.Tensor, op: str, world_size: int, group_name: str, order: torch.Tensor
) -> torch.Tensor:
    out = tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))
    return platform_collectives().reduce_scatter_tensor(out, tensor, _group(group_name), REDUCE_OPS[op])


@torch.library.custom_op("vllm_omni::all_to_all", mutates_args=("order",))
def _all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group_name: str,
    order: torch.Tensor,
) -> torch.Tensor:
    out = _all_to_all_output(tensor, output_split_sizes, input_split_sizes, group_name, order)
    return platform_collectives().all_to_all_single(
        out, tensor, _group(group_name), output_split_sizes, input_split_sizes
    )


def _all_to_all_output(tensor, output_split_sizes, input_split_sizes, group_name, order):
    rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    return tensor.new_empty((rows, *tensor.shape[1:]))


_all_reduce.register_fake(lambda tensor, op, group_name, order: None)
_broadcast.register_fake(lambda tensor, src, group_name, order: None)
_all_gather.register_fake(lambda t, world, name, order: t.new_empty((world * t.shape[0], *t.shape[1:])))
_reduce_scatter.register_fake(lambda t, op, world, name, order: t.new_empty((t.shape[0] // world, *t.shape[1:])))
_all_to_all.register_fake(_all_to_all_output)
for _op in (_all_reduce, _broadcast, _all_gather, _reduce_scatter, _all_to_all):
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


def reduce_scatter(tensor: torch.Tensor, op: str, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    return torch.ops.vllm_omni.reduce_scatter(tensor.contiguous(), op, world, group_name(group), ORDER)


def all_to_all(tensor: torch.Tensor, output_split_sizes, input_split_sizes, group) -> torch.Tensor:
    splits = [None if s is None else list(s) for s in (output_split_sizes, input_split_sizes)]
    return torch.ops.vllm_omni.all_to_all(tensor.contiguous(), *splits, group_name(group), ORDER)


# The diffusion coordinator's all-reduce, all-gather and broadcast where its process stages: eager through the
# platform's collectives, compiled through the ops above.
def coordinator_all_reduce(self, input_: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``GroupCoordinator.all_reduce``: in place where it can be; use the return value."""
    if self.world_size == 1:
        return input_
    if not torch.compiler.is_compiling():
        return platform_collectives().all_reduce(input_, self.device_group, op)
    if (name := reduce_name(op)) is None:
        torchs_own(dist.all_reduce, input_, op=op, group=self.device_group)
        return input_
    return all_reduce(input_, name, self.device_group)


def coordinator_all_gather(self, input_: torch.Tensor, dim: int = 0, separate_tensors: bool = False, group=None):
    """``GroupCoordinator.all_gather``: ranks' tensors concatenated along ``dim``, or each rank's (any ``dim``)."""
    group = self.device_group if group is None else group
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return input_
    if not -input_.dim() <= dim < input_.dim():
        raise ValueError(f"dim={dim} for a tensor of shape {tuple(input_.shape)}: expected a dim of it")
    input_ = input_.contiguous()
    if torch.compiler.is_compiling():
        stacked = all_gather(input_, group)
    else:
        stacked = input_.new_empty((world_size * input_.shape[0], *input_.shape[1:]))
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
    if torch.compiler.is_compiling():
        return broadcast(input_, self.ranks[src], self.device_group)
    return platform_collectives().broadcast(input_, self.ranks[src], self.device_group)
