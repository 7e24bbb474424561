# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The platform's collectives as the request path reaches them, this process's choice (``staging()``, fixed for its
life), and the diffusion coordinator's all-reduce, all-gather and broadcast where it stages, eagerly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm_omni.platforms import current_omni_platform

from .persistent_collectives import Collectives, collectives_for, unless_loading


def platform_choice() -> Collectives:
    """The current platform's collectives, also while a worker loads (for what is set up then and staged later); by
    the switch alone for a platform class without ``collectives()``."""
    choose = getattr(type(current_omni_platform), "collectives", None)  # the class's: no fallback to torch.<device>
    return choose() if choose is not None else collectives_for(current_omni_platform.device_type)


def platform_collectives() -> Collectives:
    """The current platform's collectives; plain while a worker loads its model."""
    return unless_loading(platform_choice())


@torch.compiler.assume_constant_result
def staging() -> bool:
    """Whether this process stages: fixed for its life, so compiled code reads it as a constant."""
    return platform_choice().staged


def gather_input(input_: torch.Tensor, dim: int) -> torch.Tensor:
    """The all-gather's input, row-major, once ``dim`` is known to be one of its dims."""
    if not -input_.dim() <= dim < input_.dim():
        raise ValueError(f"dim={dim} for a tensor of shape {tuple(input_.shape)}: expected a dim of it")
    return input_.contiguous()


def as_gathered(stacked: torch.Tensor, input_: torch.Tensor, dim: int, separate_tensors: bool):
    """Ranks' tensors stacked along dim 0 as ``GroupCoordinator.all_gather`` returns them."""
    parts = stacked.view(-1, *input_.shape).unbind(0)
    if separate_tensors:
        return list(parts)
    return stacked if dim % input_.dim() == 0 else torch.cat(parts, dim=dim)


def source_rank(coordinator, src: int) -> int:
    """The global rank of the coordinator's rank ``src``."""
    if src >= coordinator.world_size:
        raise ValueError(f"src={src}: expected a rank of this group, src < {coordinator.world_size}")
    return coordinator.ranks[src]


@torch.compiler.disable
def coordinator_all_reduce(self, input_: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``GroupCoordinator.all_reduce``: in place where it can be; use the return value."""
    if self.world_size == 1:
        return input_
    return platform_collectives().all_reduce(input_, self.device_group, op)


@torch.compiler.disable
def coordinator_all_gather(self, input_: torch.Tensor, dim: int = 0, separate_tensors: bool = False, group=None):
    """``GroupCoordinator.all_gather``: ranks' tensors concatenated along ``dim``, or each rank's (any ``dim``)."""
    group = self.device_group if group is None else group
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return input_
    input_ = gather_input(input_, dim)
    stacked = input_.new_empty((world_size * input_.shape[0], *input_.shape[1:]))
    platform_collectives().all_gather_into_tensor(stacked, input_, group)
    return as_gathered(stacked, input_, dim, separate_tensors)


@torch.compiler.disable
def coordinator_broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``GroupCoordinator.broadcast`` from the group's rank ``src``, in place."""
    source = source_rank(self, src)
    if self.world_size == 1:
        return input_
    return platform_collectives().broadcast(input_, source, self.device_group)
