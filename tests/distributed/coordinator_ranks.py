# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the coordinator tests: vLLM-Omni's own ``GroupCoordinator``, eager and compiled."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder, bits, close_floats, data, run_switched


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
    from vllm_omni.distributed import traced_collectives

    collectives, tensor = traced_collectives.platform_collectives(), torch.ones(3)
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


class _InPlace(_Block):
    """A caller that ignores the return value, as the text encoder's layers do: the reduction is in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = self.linear(x)
        self.group.all_reduce(reduced)
        return reduced * 2


class _Strided(_Block):
    """An all-reduce of a transposed view, in place: compiled, it goes through a contiguous copy and back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = self.linear(x).t()
        self.group.all_reduce(reduced)
        return reduced * 2


def graph_checks(rank: int, world: int) -> dict[str, Any]:
    """By switch, the collective ops of the graphs Dynamo hands the backend for a DiT block's all-reduce and
    all-gather: torch's functional collectives where staging is off, as the released coordinator traces, and
    nothing of ours; this project's ops where it is on. Each process stages or not for its life: Dynamo reads the
    switch once per compile, so each value gets its own."""
    group = coordinator(rank, world)
    report: dict[str, Any] = {}
    for switch in ("0", "1"):
        os.environ[SWITCH_ENV] = switch
        torch._dynamo.reset()
        graphs: list[torch.fx.GraphModule] = []
        keep = functools.partial(keeping_graphs, graphs)
        # Off, torch's own broadcast breaks the graph, as in the release; staged, the op carries it.
        compiled = torch.compile(_Broadcasting(group), backend=keep, dynamic=True, fullgraph=switch == "1")
        with torch.inference_mode():
            compiled(data(rank, (5, 8), torch.float32))
        targets = [str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"]
        report[switch] = sorted({t for t in targets if t.startswith(("_c10d_functional.", "vllm_omni."))})
    return report


def keeping_graphs(graphs: list, graph_module: torch.fx.GraphModule, example_inputs: list, then: Any = None) -> Any:
    """A backend that keeps the graph it is handed and runs it as traced, or hands it on to the backend ``then``."""
    graphs.append(graph_module)
    return graph_module.forward if then is None else then(graph_module, example_inputs)


def compile_checks(rank: int, world: int) -> dict[str, Any]:
    """Compiled as vLLM-Omni compiles the DiT on XPU (Inductor, dynamic shapes), whole-graph, in inference mode."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.force_disable_caches = True  # a cached graph must not hide a regression
    torch.set_num_threads(1)
    block = _Block(coordinator(rank, world))
    inputs = [data(rank, (rows, 8), torch.float32, salt=rows) for rows in (5, 9)]
    report: dict[str, Any] = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, backend=backend, dynamic=True, fullgraph=True)
        runs = {}
        for switch in ("0", "1"):
            runs[switch], runs[f"request{switch}"] = run_switched(switch, compiled, inputs, compiled=True)
        report[backend] = {
            "equal": runs["0"] == runs["1"],
            "close": close_floats(runs["0"], runs["1"]),
            "graph_breaks": sum(counters["graph_break"].values()),
            "staged_calls": runs["request1"]["calls"],
            "staged_unmanaged": runs["request1"]["unmanaged"],
        }
    os.environ[SWITCH_ENV] = "0"
    with torch.inference_mode():
        eager = [bits(block(x)) for x in inputs]
    report["aot_eager_equals_eager"] = eager == _aot(block, inputs)
    in_place = _InPlace(block.group)
    with torch.inference_mode():
        eager = [bits(in_place(x)) for x in inputs]
    report["in_place_compiled_equals_eager"] = eager == _aot(in_place, inputs)
    strided = _Strided(block.group)
    with torch.inference_mode():
        eager = [bits(strided(x)) for x in inputs]
    report["strided_compiled_equals_eager"] = eager == _aot(strided, inputs)
    dist.barrier()
    return report


def _aot(block: torch.nn.Module, inputs: list[torch.Tensor]) -> list[bytes]:
    torch._dynamo.reset()
    os.environ[SWITCH_ENV] = "1"
    compiled = torch.compile(block, backend="aot_eager", dynamic=True, fullgraph=True)
    with torch.inference_mode():
        return [bits(compiled(x)) for x in inputs]
