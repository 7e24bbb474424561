# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Parallel state and the variable-shape list all-gather, as the MiniMax-H3 checkpoint has them."""

from typing import Any

import torch
import torch.distributed as dist

_STATE: dict[str, Any] = {
    "sp_size": 1,
    "sp_rank": 0,
    "sp_process_group": None,
    "sp_enabled": False,
    "group_size": 1,
    "group_rank": 0,
    "local_process_group": None,
    "tp_size": 1,
    "tp_rank": 0,
}


def get_parallel_state() -> dict[str, Any]:
    """The module's one mutable state dict; the adapter fills it in place."""
    return _STATE


def all_gather_var_shape(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Gather tensors whose shapes differ across ranks: exchange shapes, pad flat to the largest, gather a list.

    Every call allocates its send buffer (when padded), the shape tensors and ``world_size`` receive buffers.
    """
    world = dist.get_world_size(group)
    shape = torch.tensor(tensor.shape, dtype=torch.int64, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    shapes_list = [tuple(int(d) for d in s.tolist()) for s in shapes]
    numels = [int(torch.Size(s).numel()) for s in shapes_list]
    largest = max(numels)
    flat = tensor.reshape(-1)
    if flat.numel() < largest:
        flat = torch.cat([flat, flat.new_zeros(largest - flat.numel())])
    received = [flat.new_empty(largest) for _ in range(world)]
    dist.all_gather(received, flat, group=group)
    return [buf[:n].view(s) for buf, n, s in zip(received, numels, shapes_list, strict=True)]
