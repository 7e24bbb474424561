# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for Inductor on the whole series: this checkout's own, beside the patches' helpers."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, data, run_switched
from tests.distributed.managed_ranks import _EveryKind


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
