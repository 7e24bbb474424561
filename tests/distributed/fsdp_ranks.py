# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the FSDP2 tests: a model sharded as vLLM-Omni's HSDP shards a DiT (each block, then
the root), forward in inference mode over several requests, with torch's own ``fully_shard`` as the oracle."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder, bits, data, is_persistent


class _Dit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        # Three units of unequal size, the largest first (the root, whose own parameters are gathered first): an odd
        # count of units in every order must find its blocks from request 2 on.
        self.proj_in = torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in ((64, 8), (8, 4)))
        for parameter in self.parameters():
            torch.nn.init.normal_(parameter, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x))
        return x


def _sharded(fully_shard, prefetch: int = 0) -> torch.nn.Module:
    model = _Dit()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    for i, block in enumerate(model.blocks):  # explicit prefetch: more units' outputs alive at once
        if prefetch and i + 1 < len(model.blocks):
            block.set_modules_to_forward_prefetch(list(model.blocks[i + 1 : i + 1 + prefetch]))
    return model


def _comm_name(unit: torch.nn.Module) -> str:
    """The class of the all-gather FSDP2 runs for ``unit`` (FSDP2 keeps it on the unit's parameter group)."""
    return type(unit._get_fsdp_state()._fsdp_param_group._all_gather_comm).__name__


def checks(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from vllm_omni.distributed import persistent_fsdp

    torch.set_num_threads(1)
    inputs = [data(rank, (rows, 16), torch.float32, salt=rows) for rows in (2, 3, 2)]
    report: dict[str, Any] = {}
    with torch.inference_mode():
        oracle = [bits(out) for out in map(_sharded(fully_shard), inputs)]
    for switch in ("0", "1"):
        os.environ[SWITCH_ENV] = switch
        model, recorder = _sharded(persistent_fsdp.fully_shard), BackendRecorder()
        with torch.inference_mode(), recorder:
            outputs = []
            for x in inputs:  # one forward per request
                outputs.append(model(x))
                recorder.end_request()
        report[switch] = {
            "equal": [bits(out) for out in outputs] == oracle,
            "requests": recorder.summary(),
            "custom": [_comm_name(unit) for unit in [*model.blocks, model]],
            "outputs_in_blocks": any(is_persistent(out) for out in outputs),
            "largest_unit_bytes": max(
                4 * sum(p.numel() for p in u.parameters()) for u in [model.proj_in, *model.blocks]
            ),
        }
    report["slots"] = [slot.nbytes for slot in persistent_fsdp._shared.blocks]
    os.environ[SWITCH_ENV] = "1"
    deep = _sharded(persistent_fsdp.fully_shard, prefetch=2)
    with torch.inference_mode():
        report["prefetch_equal"] = [bits(deep(x)) for x in inputs] == oracle
    os.environ[SWITCH_ENV] = "0"
    dist.barrier()
    return report
