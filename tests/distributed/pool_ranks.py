# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Rank side of the pool-mode tests: every kind through the coordinator's collectives and ``managed_distributed`` in
the request pool, inside and outside a request, where rank 0 hands over tensors the request made and the other ranks
tensors made before it, beside the plain collectives. Calls larger than a 1 MiB block cap: a rank that staged or
chunked on its own would run other wire collectives than its peers. The pool is a stand-in for ``torch.xpu.MemPool``
(``mem_pool_stand_in``; no XPU here): what is proven is what reaches the backend, not where memory lands."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import SWITCH_ENV, BackendRecorder

Source = Callable[[str, torch.Tensor], torch.Tensor]
NUMEL = 3 << 18  # 3 MiB of float32: three times the cap


def kinds(d, rank: int, world: int, source: Source) -> dict[str, torch.Tensor]:
    """Each kind's result through ``d`` (``torch.distributed`` or ``managed_distributed``), on ``source`` tensors."""
    results = {}
    base = torch.arange(NUMEL, dtype=torch.float32) / 3
    results["all_reduce"] = source("all_reduce", base + rank)
    d.all_reduce(results["all_reduce"])
    results["all_gather"] = source("gather_out", torch.zeros(NUMEL))
    d.all_gather_into_tensor(results["all_gather"], source("gather_in", base[: NUMEL // world] * (rank + 1)))
    results["reduce_scatter"] = source("scatter_out", torch.zeros(NUMEL // world))
    d.reduce_scatter_tensor(results["reduce_scatter"], source("scatter_in", base * (rank + 1)))
    results["broadcast"] = source("broadcast", base * rank)
    d.broadcast(results["broadcast"], src=0)
    results["all_to_all"] = source("a2a_out", torch.zeros(NUMEL))
    d.all_to_all_single(results["all_to_all"], source("a2a_in", base + 10 * rank))
    received = source("p2p_recv", torch.zeros(NUMEL // 8))
    ops = [
        d.P2POp(d.isend, source("p2p_send", base[: NUMEL // 8] + rank), (rank + 1) % world),
        d.P2POp(d.irecv, received, (rank - 1) % world),
    ]
    for work in d.batch_isend_irecv(ops):
        work.wait()
    results["batch_isend_irecv"] = received
    d.barrier()
    return {name: tensor.clone() for name, tensor in results.items()}


def checks(rank: int, world: int) -> dict:
    from tests.distributed import mem_pool_stand_in as mem_pool
    from vllm_omni.distributed import managed_distributed, request_collectives, request_pool

    os.environ["VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"] = "1"
    before: dict[str, torch.Tensor] = {}

    def keep(name: str, values: torch.Tensor) -> torch.Tensor:
        before[name] = values.clone()
        return before[name]

    def mine(name: str, values: torch.Tensor) -> torch.Tensor:
        # Rank 0's tensors are made in the request (the pool's); every other rank's were made before it.
        return values.clone() if rank == 0 else before[name].copy_(values)

    oracle = kinds(dist, rank, world, keep)  # also makes the tensors that outlive it, before any request
    os.environ[request_pool.POOL_ENV], os.environ[SWITCH_ENV] = "1", "auto"
    pool = request_pool.RequestPool(mem_pool, torch.device("cpu"))

    def run(in_request: bool) -> dict:
        recorder = BackendRecorder()
        with recorder, request_pool.use_request_pool(pool if in_request else None):
            results = kinds(managed_distributed, rank, world, mine)
        collectives = request_collectives.platform_collectives()
        return {
            "equal": all(torch.equal(results[name], oracle[name]) for name in oracle),
            "calls": [name for name, _ in recorder.requests[0]],
            "staged": collectives.staged,
            "stats": {k: v for k, v in collectives.stats().items() if k != "block_cap_bytes"},
        }

    report = {"in_request": run(True), "outside_request": run(False), "in_request_again": run(True)}
    report |= {"pool_requests": pool.requests, "pools_made": mem_pool.MemPool.made, "active_after": pool.active}
    report["snapshots"] = pool._pool.snapshots  # nothing asked the pool what it holds
    os.environ[request_pool.POOL_ENV], os.environ[SWITCH_ENV] = "0", "0"
    dist.barrier()
    return report
