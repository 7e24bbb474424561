# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the ``managed_distributed`` tests: every collective a request-path module calls
through it, eager and compiled, with ``torch.distributed`` itself as the oracle."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder, bits, data, run_switched
from tests.distributed.coordinator_ranks import keeping_graphs


def every_kind(d: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor collective through ``d`` (``torch.distributed`` or ``managed_distributed``); the results."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    reduced = x * 2
    d.all_reduce(reduced, group=group)
    sent = x + 1
    d.broadcast(sent, src=world - 1, group=group)
    listed = [torch.empty_like(x) for _ in range(world)]
    d.all_gather(listed, x, group=group)
    into = x.new_empty((world * x.shape[0], *x.shape[1:]))
    d.all_gather_into_tensor(into, x, group=group)
    scattered = torch.empty_like(x)
    d.reduce_scatter_tensor(scattered, torch.cat([x * (peer + 1) for peer in range(world)]), group=group)
    swapped = x.new_empty((world * x.shape[0], *x.shape[1:]))
    d.all_to_all_single(swapped, torch.cat([x - peer for peer in range(world)]), group=group)
    sends = [1 + (rank + peer) % 2 for peer in range(world)]  # rows this rank sends each peer
    takes = [1 + (peer + rank) % 2 for peer in range(world)]
    uneven_in = x[:1].expand(sum(sends), -1) * (rank + 1)
    uneven = x.new_empty((sum(takes), x.shape[1]))
    d.all_to_all_single(uneven, uneven_in.contiguous(), takes, sends, group=group)
    parts = [torch.empty_like(x) for _ in range(world)]
    d.all_to_all(parts, [x * (peer + 3) for peer in range(world)], group=group)
    return [reduced, sent, *listed, into, scattered, swapped, uneven, *parts, x]


class _EveryKind(torch.nn.Module):
    def __init__(self, d: Any) -> None:
        super().__init__()
        self.d = d
        self.linear = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.linear.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.flatten() for t in every_kind(self.d, self.linear(x))])


def eager_extras(d: Any, rank: int, world: int) -> list[torch.Tensor]:
    """``async_op=True`` and point-to-point calls, eager only (Dynamo breaks the graph at them)."""
    x = data(rank, (3, 4), torch.float32, salt=5)
    reduced = x.clone()
    work = d.all_reduce(reduced, async_op=True)
    work.wait()
    ahead, behind = (rank + 1) % world, (rank - 1) % world
    got_async, got_sync = torch.zeros_like(x), torch.zeros_like(x)
    works = [d.isend(x, ahead), d.irecv(got_async, behind)]
    for work in works:
        work.wait()
    if rank % 2 == 0:  # sends first on even ranks, receives first on odd ones: no cycle of blocking calls
        d.send(x * 2, ahead)
        source = d.recv(got_sync, behind)
    else:
        source = d.recv(got_sync, behind)
        d.send(x * 2, ahead)
    return [reduced, got_async, got_sync, torch.tensor([source]), x]


def _outcome(call: Any) -> Any:
    """What a call leaves: its returned tensor's bits, or the type of what it raised."""
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - the type is the observation
        return type(error).__name__
    return None if result is None else bits(result)


def edge_cases(d: Any, rank: int, world: int, pair: Any) -> dict[str, Any]:
    """Calls staging hands to torch's own or must answer as it does: async futures, a group without this rank,
    unlike dtypes, a compiled all-to-all with only input splits."""
    from vllm_omni.distributed.module_collectives import _StagedBatch

    x = data(rank, (2, 4), torch.float32, salt=9)
    reduced = x.clone()
    work = d.all_reduce(reduced, async_op=True)
    work.wait()
    outsider = torch.zeros(2)
    found = {
        "future": [bits(t) for t in work.get_future().value()],
        "torchs_work": type(work) is not _StagedBatch,
        "non_member": d.all_reduce(outsider, group=pair, async_op=True) is None if rank >= 2 else None,
        "gather_float64": _outcome(lambda: d.all_gather_into_tensor(x.new_empty(2 * world, 4).double(), x)),
        "scatter_float64": _outcome(lambda: d.reduce_scatter_tensor(x.double(), x.repeat(world, 1))),
    }
    if rank < 2:
        d.all_reduce(outsider, group=pair, async_op=True).wait()

    def one_sided(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        d.all_to_all_single(output, input, None, [2] * world)
        return output

    torch._dynamo.reset()
    compiled = torch.compile(one_sided, backend="aot_eager")
    found["compiled_one_sided"] = _outcome(lambda: compiled(x.new_empty(2 * world, 4), x.repeat(world, 1)))
    return found


def checks(rank: int, world: int) -> dict[str, Any]:
    import torch._inductor.config

    from vllm_omni.distributed import managed_distributed

    torch._inductor.config.force_disable_caches = True
    torch.set_num_threads(1)
    inputs = [data(rank, (rows, 8), torch.float32, salt=rows) for rows in (2, 4)]
    report: dict[str, Any] = {}
    pair = dist.new_group([0, 1])
    report["edges_oracle"] = edge_cases(dist, rank, world, pair)
    module = _EveryKind(dist)
    with torch.inference_mode():
        oracle = [bits(module(x)) for x in inputs]
        extras_oracle = [bits(t) for t in eager_extras(dist, rank, world)]
    module.d = managed_distributed
    for switch in ("0", "1"):
        report[f"eager{switch}"] = run_switched(switch, module, inputs)
        recorder = BackendRecorder()
        with torch.inference_mode(), recorder:
            report[f"extras{switch}"] = [bits(t) for t in eager_extras(managed_distributed, rank, world)]
        report[f"extras_unmanaged{switch}"] = recorder.summary()[0]["unmanaged"]
        report[f"extras_calls{switch}"] = [name for name, _ in recorder.requests[0]]
        report[f"edges{switch}"] = edge_cases(managed_distributed, rank, world, pair)
    # Compiled with aot_eager, keeping each graph Dynamo hands it: torch's own module (the release), then this one
    # with staging off (torch's own calls, breaking the graph where torch's do) and on (whole-graph). Graph breaks are
    # counted as graphs: Dynamo's counter also counts its retries, one per nested frame.
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    arms = (("release", dist, False), ("0", managed_distributed, False), ("1", managed_distributed, True))
    for arm, d, fullgraph in arms:
        graphs: list = []
        module.d = d
        keep = functools.partial(keeping_graphs, graphs, then=aot_eager)
        compiled = torch.compile(module, backend=keep, dynamic=True, fullgraph=fullgraph)
        report[f"aot_eager{arm}"] = run_switched("0" if arm == "release" else arm, compiled, inputs, True)
        report[f"graphs{arm}"] = len(graphs)
        targets = {str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"}
        report[f"ops{arm}"] = sorted(t for t in targets if t.startswith(("_c10d_functional.", "vllm_omni.")))
    report["oracle"], report["extras_oracle"] = oracle, extras_oracle
    report["non_member_point_to_point"] = non_member_point_to_point(rank, world)
    os.environ[SWITCH_ENV] = "0"
    dist.barrier()
    return report


def non_member_point_to_point(rank: int, world: int) -> dict[str, Any]:
    """Point-to-point calls through ``managed_distributed`` on a group this rank is not in, beside torch's own: what
    each returns or raises (a member of the group calls nothing)."""
    from vllm_omni.distributed import managed_distributed

    pair = dist.new_group([0, 2])
    report: dict[str, Any] = {}
    if rank in (0, 2):
        dist.barrier()
        return report
    saved, os.environ[SWITCH_ENV] = os.environ.get(SWITCH_ENV), "1"
    try:
        for name, d in (("plain", dist), ("staged", managed_distributed)):
            report[name] = _point_to_point_outcomes(d, data(rank, (2, 3), torch.float32, salt=7), pair)
            report[name]["untouched"] = report[name].pop("tensor") == bits(data(rank, (2, 3), torch.float32, salt=7))
    finally:
        os.environ.pop(SWITCH_ENV) if saved is None else os.environ.__setitem__(SWITCH_ENV, saved)
    dist.barrier()
    return report


def _point_to_point_outcomes(d: Any, tensor: torch.Tensor, group: Any) -> dict[str, Any]:
    calls = {
        "isend": lambda: d.isend(tensor, 0, group=group),
        "irecv": lambda: d.irecv(tensor, 2, group=group),
        "send": lambda: d.send(tensor, 0, group=group),
        "recv": lambda: d.recv(tensor, 2, group=group),
        "batch": lambda: d.batch_isend_irecv([d.P2POp(d.isend, tensor, 0, group)]),
    }
    return {**{kind: _returned(call) for kind, call in calls.items()}, "tensor": bits(tensor)}


def _returned(call: Callable) -> str:
    """What a call returned (its repr), or the error's type and message."""
    try:
        return f"returned {call()!r}"
    except Exception as error:  # noqa: BLE001 - compared: the staged call must raise what the plain one raises
        return f"{type(error).__name__}: {error}"
