# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the compiled coordinator's tests: whole graphs through the registered ops."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, bits, close_floats, data, run_switched
from tests.distributed.coordinator_ranks import _Block, _Broadcasting, coordinator, keeping_graphs


def whole_graph_ops(rank: int, world: int) -> list[str]:
    """The collective ops of the one graph a staging process's DiT block compiles to, whole."""
    group = coordinator(rank, world)
    os.environ[SWITCH_ENV] = "1"
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    compiled = torch.compile(
        _Broadcasting(group), backend=functools.partial(keeping_graphs, graphs), dynamic=True, fullgraph=True
    )
    with torch.inference_mode():
        compiled(data(rank, (5, 8), torch.float32))
    targets = [str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"]
    return [len(graphs), sorted({t for t in targets if t.startswith(("_c10d_functional.", "vllm_omni."))})]


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


def compile_checks(rank: int, world: int, backends: tuple[str, ...] = ("aot_eager",)) -> dict[str, Any]:
    """Compiled whole-graph with ``backends`` (dynamic shapes, inference mode), as vLLM-Omni compiles the DiT; then,
    with ``aot_eager``, callers that ignore the return value or hand a strided view. Inductor on ranks runs in this
    checkout's own tests, once, on the whole series (``tests/distributed/test_inductor_on_ranks.py``)."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.force_disable_caches = True  # a cached graph must not hide a regression
    torch.set_num_threads(1)
    block = _Block(coordinator(rank, world))
    inputs = [data(rank, (rows, 8), torch.float32, salt=rows) for rows in (5, 9)]
    report: dict[str, Any] = {}
    for backend in backends:
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
    if backends != ("aot_eager",):
        dist.barrier()
        return report
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
