# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the program-order tests: one function that calls every kind ``managed_distributed``
traces, compiled whole with Inductor in inference mode, with split sizes that differ by rank (so the ranks' graphs
differ), beside the same function run eagerly."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder, bits, data

PROGRAM_ORDER = [
    "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "all_to_all", "all_gather", "all_reduce",
]  # fmt: skip
_KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather"}
_KIND |= {"reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}


def every_kind_in_program_order(d: Any, x: torch.Tensor) -> torch.Tensor:
    """Independent collectives, none reading another's result: only program order ties them together."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [1 + (rank + peer) % 3 for peer in range(world)]  # Python ints, constants of this rank's graph
    takes = [1 + (peer + rank) % 3 for peer in range(world)]
    reduced = x * 2
    d.all_reduce(reduced)
    sent = x + 1
    d.broadcast(sent, src=world - 1)
    into = x.new_empty((world * x.shape[0], *x.shape[1:]))
    d.all_gather_into_tensor(into, x * 3)
    scattered = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    d.reduce_scatter_tensor(scattered, x * 4)
    swapped = torch.empty_like(x)
    d.all_to_all_single(swapped, x * 5)
    uneven = x.new_empty((sum(takes), x.shape[1]))
    d.all_to_all_single(uneven, (x[:1] * 6).expand(sum(sends), -1).contiguous(), takes, sends)
    listed = [torch.empty_like(x) for _ in range(world)]
    d.all_gather(listed, x * 7)
    largest = x * 8
    d.all_reduce(largest, op=dist.ReduceOp.MAX)
    return torch.cat([t.flatten() for t in (reduced, sent, into, scattered, swapped, uneven, *listed, largest)])


def _run(function: Any, x: torch.Tensor) -> tuple[bytes, list[str]]:
    recorder = BackendRecorder()
    with torch.inference_mode(), recorder:
        out = function(x)
    return bits(out), [_KIND.get(name, name) for name, _ in recorder.requests[0]]


def checks(rank: int, world: int) -> dict[str, Any]:
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from vllm_omni.distributed import managed_distributed

    torch._inductor.config.force_disable_caches = True
    torch.set_num_threads(1)
    x = data(rank, (world * 2, 6), torch.float32, salt=3)
    report: dict[str, Any] = {}
    report["plain"] = _run(lambda t: every_kind_in_program_order(dist, t), x)
    for switch in ("0", "1"):
        os.environ[SWITCH_ENV] = switch
        report[f"eager{switch}"] = _run(lambda t: every_kind_in_program_order(managed_distributed, t), x)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(
        lambda t: every_kind_in_program_order(managed_distributed, t), backend="inductor", fullgraph=True
    )
    report["compiled"] = _run(compiled, x)  # staged, the switch last set
    report["breaks"] = sum(counters["graph_break"].values())
    os.environ[SWITCH_ENV] = "0"
    dist.barrier()
    return report
