# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for Inductor on the whole series: this checkout's own, beside the patches' helpers. Each
start of ranks pays their imports and Inductor's first compile, so one start runs every check of its world size."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch.distributed as dist

from tests.distributed import order_ranks, sequence_parallel_ranks, traced_ranks
from tests.distributed.collective_ranks import SWITCH_ENV, data, run_switched
from tests.distributed.managed_ranks import _EveryKind

INDUCTOR = ("inductor",)


def managed_checks(rank: int, world: int) -> dict[str, Any]:
    """Every kind compiled whole-graph with Inductor, staged, beside ``aot_eager`` with staging off."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from vllm_omni.distributed import managed_distributed

    torch._inductor.config.force_disable_caches = True
    torch.set_num_threads(1)
    inputs = [data(rank, (rows, 8), torch.float32, salt=rows) for rows in (2, 4)]
    module = _EveryKind(managed_distributed)
    report = {"aot_eager0": run_switched("0", torch.compile(module, backend="aot_eager", dynamic=True), inputs, True)}
    counters.clear()
    compiled = torch.compile(module, backend="inductor", dynamic=True, fullgraph=True)
    report["inductor1"] = run_switched("1", compiled, inputs, True)
    report["inductor_breaks1"] = sum(counters["graph_break"].values())
    os.environ[SWITCH_ENV] = "0"
    dist.barrier()
    return report


def _one_after_another(rank: int, world: int, checks: dict[str, Any]) -> dict[str, Any]:
    """Each check as if it had the process to itself: Dynamo's caches and counters reset before it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    report = {}
    for name, check in checks.items():
        torch._dynamo.reset()
        counters.clear()
        report[name] = check(rank, world)
    return report


def two_rank_checks(rank: int, world: int) -> dict[str, Any]:
    """The coordinator compiled whole, then Ulysses and Ring."""
    coordinator = functools.partial(traced_ranks.compile_checks, backends=INDUCTOR)
    sequence_parallel = functools.partial(sequence_parallel_ranks.compile_checks, backends=INDUCTOR)
    return _one_after_another(rank, world, {"coordinator": coordinator, "sequence_parallel": sequence_parallel})


def four_rank_checks(rank: int, world: int) -> dict[str, Any]:
    """Every kind through ``managed_distributed``, then the program order."""
    return _one_after_another(rank, world, {"managed": managed_checks, "order": order_ranks.checks})
