# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the coordinator tests: vLLM-Omni's own ``GroupCoordinator``, eager and compiled."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder, bits, data, run_switched


def coordinator(rank: int, world: int) -> Any:
    """A diffusion ``GroupCoordinator`` over every rank."""
    from vllm_omni.diffusion.distributed import group_coordinator

    return group_coordinator.GroupCoordinator([list(range(world))], rank, "gloo")


def eager_checks(rank: int, world: int) -> dict[str, Any]:
    group = coordinator(rank, world)
    cases = {
        "all_reduce": lambda: [group.all_reduce(data(rank, (6, 5), torch.bfloat16))],
        "all_gather_dim0": lambda: [group.all_gather(data(rank, (3, 4), torch.float32))],
        "all_gather_dim1": lambda: [group.all_gather(data(rank, (3, 4, 2), torch.float16), dim=1)],
        "all_gather_dim-1": lambda: [group.all_gather(data(rank, (3, 4), torch.int64), dim=-1)],
        "all_gather_separate": lambda: group.all_gather(data(rank, (2, 3), torch.float32), separate_tensors=True),
        "all_gather_separate_dim1": lambda: group.all_gather(
            data(rank, (1, 3), torch.float32), dim=1, separate_tensors=True
        ),
        "broadcast": lambda: [group.broadcast(data(rank, (4, 4), torch.float32), src=world - 1)],
    }
    os.environ[SWITCH_ENV] = "0"
    expected = {name: [bits(t) for t in case()] for name, case in cases.items()}
    os.environ[SWITCH_ENV] = "1"
    recorder = BackendRecorder()
    with recorder:
        got = {name: [bits(t) for t in case()] for name, case in cases.items()}
    # What the released coordinator returns, by its documented semantics: ranks' tensors concatenated along dim.
    torch_oracle = torch.cat([data(r, (3, 4, 2), torch.float16) for r in range(world)], dim=1)
    tensor = data(rank, (5,), torch.float32)
    errors = {}
    for name, call in {
        "dim": lambda: group.all_gather(tensor, dim=1),
        "src": lambda: group.broadcast(tensor, src=world),
    }.items():
        try:
            call()
        except ValueError as error:
            errors[name] = str(error)
    return {
        "equal": {name: got[name] == expected[name] for name in cases},
        "dim1_is_concatenation": got["all_gather_dim1"] == [bits(torch_oracle)],
        # As released: with separate tensors each rank's tensor comes back whatever ``dim`` says.
        "separate_dim1_is_each_ranks": got["all_gather_separate_dim1"]
        == [bits(data(r, (1, 3), torch.float32)) for r in range(world)],
        "in_place": group.all_reduce(tensor) is tensor,
        "unmanaged": recorder.summary()[0]["unmanaged"],
        "control": _control_call_keeps_no_block(group),
        "errors": errors,
    }


def _control_call_keeps_no_block(group: Any) -> bool:
    """A collective on the coordinator's gloo group runs plain: no block appears for it, and it reduces."""
    from vllm_omni.distributed import request_collectives

    collectives, tensor = request_collectives.platform_collectives(), torch.ones(3)
    before = collectives.stats()["blocks"]
    collectives.all_reduce(tensor, group.cpu_group)
    return collectives.stats()["blocks"] == before and tensor.tolist() == [group.world_size] * 3


class _Block(torch.nn.Module):
    """A DiT block's tensor-parallel pattern: a row-parallel all-reduce, then a column-parallel gather."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.linear = torch.nn.Linear(8, 8)
        torch.nn.init.normal_(self.linear.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = self.group.all_reduce(self.linear(x))
        return torch.nn.functional.gelu(self.group.all_gather(reduced, dim=-1)) * 2


class _Broadcasting(_Block):
    """A DiT block's pattern, then a broadcast from the last rank, as the text encoder's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.group.broadcast(out, src=self.group.world_size - 1) + 1


def graph_checks(rank: int, world: int) -> dict[str, Any]:
    """By switch, the collective ops of the graphs Dynamo hands the backend for a DiT block's all-reduce, all-gather
    and broadcast, the results' bits, and what the backend was handed. Each process stages or not for its life:
    Dynamo reads the switch once per compile, so each value gets its own."""
    block = _Broadcasting(coordinator(rank, world))  # one module: its bias is drawn from the global generator
    inputs = [data(rank, (rows, 8), torch.float32, salt=rows) for rows in (5, 9)]
    report: dict[str, Any] = {}
    for switch in ("0", "1"):
        graphs: list[torch.fx.GraphModule] = []
        compiled = torch.compile(block, backend=functools.partial(keeping_graphs, graphs), dynamic=True)
        report[f"bits{switch}"], report[f"request{switch}"] = run_switched(switch, compiled, inputs, compiled=True)
        targets = [str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"]
        report[switch] = sorted({t for t in targets if t.startswith(("_c10d_functional.", "vllm_omni."))})
    return report


def keeping_graphs(graphs: list, graph_module: torch.fx.GraphModule, example_inputs: list, then: Any = None) -> Any:
    """A backend that keeps the graph it is handed and runs it as traced, or hands it on to the backend ``then``."""
    graphs.append(graph_module)
    return graph_module.forward if then is None else then(graph_module, example_inputs)
