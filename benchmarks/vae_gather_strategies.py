# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""The tile-gather strategies the benchmark compares, each installed on one adapter's checkpoint instance.

- ``checkpoint``: the checkpoint's own variable-shape list gather (stock).
- ``recv-only``: one persistent receive buffer and a fresh send buffer each call, the shape of vLLM-Omni
  0.30.0's override and of PR #6996 (kept here for comparison only).
- ``ours``: ``install_tile_gather_reuse``, send and receive in one stable workspace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# vae_gather and the block are imported where they are used, not here: the benchmark's ranks unpickle this module
# before they set up their imports, and tests put the working tree's modules first at that point.
STRATEGIES = ("checkpoint", "recv-only", "ours")


class ReceiveOnlyTileGather:
    """Stable receive buffer, fresh send buffer: the stacked local share is a new allocation every call."""

    def __init__(self, parallel_state: Callable[[], dict[str, Any]]) -> None:
        from vllm_omni.distributed.collective_workspaces import GrowOnlyBlock

        self._parallel_state = parallel_state
        self.workspace = GrowOnlyBlock()

    def __call__(self, tasks: list[torch.Tensor], num_tiles: int) -> list[torch.Tensor]:
        state = self._parallel_state()
        world, group = state["sp_size"], state["sp_process_group"]
        max_tasks = math.ceil(num_tiles / world)
        send = tasks[0].new_zeros((max_tasks, *tasks[0].shape))
        torch.stack(tasks, out=send[: len(tasks)])
        self.workspace.ensure(world * send.nbytes, send.device, group)
        received = self.workspace.block[: world * send.nbytes].view(send.dtype).view(world, *send.shape)
        dist.all_gather_single(received.view(-1), send.view(-1), group=group)
        return [received[g % world, g // world].clone() for g in range(num_tiles)]

    def stats(self) -> dict[str, int]:
        return {"workspace_bytes": self.workspace.nbytes, "allocs": self.workspace.allocs}


def install_strategy(adapter: Any, name: str) -> Any:
    """Install ``name`` on ``adapter``; returns the object whose ``stats()`` reports its workspace, or None."""
    from vllm_omni.diffusion.models.minimax_h3.vae_gather import get_tile_gather, install_tile_gather_reuse

    if name == "checkpoint":
        # vLLM-Omni 0.30.0 binds its own receive-side override on XPU; the stock gather is the class's method.
        vars(adapter.model).pop("_all_gather_tiled_results", None)
        return None
    if name == "recv-only":
        gather = ReceiveOnlyTileGather(adapter._native_parallel_state)
        adapter.model._all_gather_tiled_results = gather
        return gather
    if name == "ours":
        install_tile_gather_reuse(adapter, enabled=True)
        return get_tile_gather(adapter)
    raise ValueError(f"strategy={name!r}: expected one of {STRATEGIES}")
