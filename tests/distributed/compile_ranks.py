# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the compile tests: collectives inside ``torch.compile``, the layer off and on.

vLLM-Omni compiles the DiT on XPU (Inductor, ``dynamic=True``), so its tensor-parallel collectives run inside
compiled code. Each function is compiled afresh per backend and mode; it runs on two input shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.layer_ranks import BackendRecorder, bits, data

BACKENDS = ("eager", "aot_eager", "inductor")


def traced_kinds(world: int) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """The kinds Dynamo traces into the graph (a tensor-parallel block's all-reduce and gathers among them)."""

    def forward(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        dist.all_reduce(y)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        gathered = y.new_empty((world * y.shape[0], y.shape[1]))
        dist.all_gather_into_tensor(gathered, y)
        single = y.new_empty((world * y.shape[0], y.shape[1]))
        dist.all_gather_single(single, y * 3)
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y + 1)
        exchanged = torch.empty_like(gathered)
        dist.all_to_all_single(exchanged, gathered)
        return torch.cat([gathered, single, torch.cat(parts), exchanged]) * 2

    return forward


def unused_results(world: int) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """Collectives whose results the function never reads: every rank must still run each of them."""

    def forward(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        dist.all_reduce(y * 1)
        gathered = y.new_empty((world * y.shape[0], y.shape[1]))
        dist.all_gather_into_tensor(gathered, y)
        dist.all_to_all_single(torch.empty_like(gathered), gathered)
        return y * 2

    return forward


def odd_layouts(world: int) -> dict[str, Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]]:
    """Layouts where the functional collective's row-major view of a tensor decides the result."""

    def view_with_gaps(linear, x):
        y = linear(x)
        dist.all_reduce(y[:, :2])
        return y * 1

    def transposed_graph_input(linear, x):
        xt = x.t()
        dist.all_reduce(xt)
        return xt * 1

    def uneven_list_gather(linear, x):
        y = linear(x)
        parts = [torch.zeros_like(y) for _ in range(world - 1)] + [torch.zeros(1, y.shape[1])]
        dist.all_gather(parts, y)
        return torch.cat(parts)

    return {fn.__name__: fn for fn in (view_with_gaps, transposed_graph_input, uneven_list_gather)}


def breaking_kinds(rank: int, world: int) -> dict[str, Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]]:
    """Kinds the plain collective breaks the graph at: the staged one must break it at the same call, no more."""

    def broadcast(linear, x):
        y = linear(x)
        dist.broadcast(y, src=world - 1)
        return y * 2

    def barrier(linear, x):
        y = linear(x)
        dist.barrier()
        return y * 2

    def async_all_reduce(linear, x):
        y = linear(x)
        dist.all_reduce(y, async_op=True).wait()
        return y * 2

    def ring_batch(linear, x):
        y = linear(x)
        received = torch.empty_like(y)
        ops = [dist.P2POp(dist.isend, y, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received * 2

    return {fn.__name__: fn for fn in (broadcast, barrier, async_all_reduce, ring_batch)}


def _run_compiled(fn, backend: str, linear, inputs) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    with torch.no_grad():
        outputs = []
        for x in inputs:  # a clone: a function may write its input, and every run starts from the same values
            try:
                outputs.append(compiled(linear, x.clone()))
            except Exception as error:
                outputs.append(type(error).__name__)
    outputs = [o if isinstance(o, str) else bits(o).tolist() for o in outputs]
    return {
        "bits": outputs,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _gradients(backend: str | None, inputs: list[torch.Tensor]) -> list[list[int]]:
    """A weight's gradient through an all-reduce (training); ``backend=None`` runs it uncompiled."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)

    def loss(x: torch.Tensor) -> torch.Tensor:
        y = linear(x)
        dist.all_reduce(y)
        return (y * y).sum()

    run = loss if backend is None else torch.compile(loss, backend=backend, dynamic=True)
    grads = []
    for x in inputs:
        linear.zero_grad()
        run(x.clone()).backward()
        grads.append(bits(linear.weight.grad).tolist())
    return grads


def checks(rank: int, world: int) -> dict[str, Any]:
    from vllm_omni.distributed.persistent_collectives import (
        install_persistent_collectives,
        installed,
        uninstall_persistent_collectives,
    )

    # A cached graph from an earlier run could hide a collective dropped as dead code: compile afresh.
    torch._inductor.config.force_disable_caches = True
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    inputs = [data(rank, (n, 8), torch.float32, salt=n) for n in (3, 5)]
    report: dict[str, Any] = {"eager": {}, "off": {}, "on": {}, "staged": {}, "handed_workspaces_only": {}}
    with torch.no_grad():
        report["eager"]["traced"] = [bits(traced_kinds(world)(linear, x)).tolist() for x in inputs]
    report["eager"]["gradients"] = _gradients(None, inputs)
    for mode in ("off", "on"):
        if mode == "on":
            assert install_persistent_collectives(enabled=True, device_type="cpu")
            installed().reserve(1 << 16)  # no workspace grows below, so every block handed over is still there
        for backend in BACKENDS:
            recorder = BackendRecorder(installed()) if mode == "on" else None
            before = installed().stats()["staged_calls"] if mode == "on" else 0
            report[mode][f"traced/{backend}"] = _run_compiled(traced_kinds(world), backend, linear, inputs)
            if recorder is not None:
                report["staged"][f"traced/{backend}"] = installed().stats()["staged_calls"] - before
                handed = [ptr for _, call in recorder.take() for ptr in call]
                pools = installed().all_pools()
                workspaces = {w.block.untyped_storage().data_ptr() for p in pools for w in p.workspaces}
                report["handed_workspaces_only"][f"traced/{backend}"] = bool(handed) and set(handed) <= workspaces
                recorder.close()
        for backend in ("aot_eager", "inductor"):
            before = installed().stats()["staged_calls"] if mode == "on" else 0
            report[mode][f"unused/{backend}"] = _run_compiled(unused_results(world), backend, linear, inputs)
            if mode == "on":
                report["staged"][f"unused/{backend}"] = installed().stats()["staged_calls"] - before
        for backend in ("aot_eager", "inductor"):
            report[mode][f"gradients/{backend}"] = _gradients(backend, inputs)
        for name, fn in odd_layouts(world).items():
            for backend in ("aot_eager", "inductor"):
                report[mode][f"{name}/{backend}"] = _run_compiled(fn, backend, linear, inputs)
        for name, fn in breaking_kinds(rank, world).items():
            before = installed().stats()["staged_calls"] if mode == "on" else 0
            report[mode][name] = _run_compiled(fn, "eager", linear, inputs)
            if mode == "on":
                report["staged"][name] = installed().stats()["staged_calls"] - before
    uninstall_persistent_collectives()
    return report
