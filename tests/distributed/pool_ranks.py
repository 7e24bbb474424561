# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Rank side of the pool-mode tests: every staged kind on tensors a request makes and on tensors made before it,
inside and outside a request, beside the plain collectives. The pool is the CPU test platform's stand-in for
``torch.xpu.MemPool`` (no XPU here), so what is proven is the routing and the bits, not where memory lands."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Source = Callable[[str, torch.Tensor], torch.Tensor]


def kinds(collectives, rank: int, world: int, source: Source) -> dict[str, torch.Tensor]:
    """Each kind's result, on tensors from ``source(name, values)``."""
    group, cpu = dist.group.WORLD, torch.device("cpu")
    results = {}
    tensor = source("all_reduce", torch.arange(8, dtype=torch.float32) / 3 + rank)
    results["all_reduce"] = collectives.all_reduce(tensor, group)
    output = source("gather_out", torch.zeros(4 * world))
    collectives.all_gather_into_tensor(output, source("gather_in", torch.full((4,), rank / 7)), group)
    results["all_gather_into_tensor"] = output
    output = source("scatter_out", torch.zeros(4))
    collectives.reduce_scatter_tensor(output, source("scatter_in", torch.arange(4.0 * world) * (rank + 1) / 3), group)
    results["reduce_scatter_tensor"] = output
    results["broadcast"] = collectives.broadcast(source("broadcast", torch.full((5,), float(rank))), 0, group)
    output = source("a2a_out", torch.zeros(2 * world))
    collectives.all_to_all_single(output, source("a2a_in", torch.arange(2.0 * world) + 10 * rank), group)
    results["all_to_all_single"] = output
    received = source("p2p_recv", torch.zeros(3))
    ops = [
        dist.P2POp(dist.isend, source("p2p_send", torch.full((3,), rank + 0.5)), (rank + 1) % world),
        dist.P2POp(dist.irecv, received, (rank - 1) % world),
    ]
    for work in collectives.batch_isend_irecv(ops):
        work.wait()
    results["batch_isend_irecv"] = received
    collectives.barrier(group, cpu)
    return {name: tensor.clone() for name, tensor in results.items()}


KINDS = 7  # the calls ``kinds`` makes, barrier included


def checks(rank: int, world: int) -> dict:
    from tests.distributed import mem_pool_stand_in as mem_pool
    from vllm_omni.distributed import persistent_collectives as pc
    from vllm_omni.distributed import request_pool

    plain, pooled = pc.Collectives(persistent=False), pc.Collectives(persistent=True, pooled=True)
    made_before: dict[str, torch.Tensor] = {}

    def fresh(name: str, values: torch.Tensor) -> torch.Tensor:
        return values.clone()

    def keep(name: str, values: torch.Tensor) -> torch.Tensor:
        made_before[name] = values.clone()
        return made_before[name]

    def reuse(name: str, values: torch.Tensor) -> torch.Tensor:
        return made_before[name].copy_(values)

    oracle = kinds(plain, rank, world, keep)  # also makes the tensors that outlive it, before any request
    pool = request_pool._worker = request_pool.RequestPool(mem_pool)  # what open_worker_pool makes in a worker

    def run(source: Source, in_request: bool) -> dict:
        before = pooled.stats()
        if in_request:
            with request_pool.request_memory():
                results = kinds(pooled, rank, world, source)
        else:
            results = kinds(pooled, rank, world, source)
        after = pooled.stats()
        return {
            "equal": all(torch.equal(results[name], oracle[name]) for name in oracle),
            **{key: after[key] - before[key] for key in ("pooled_calls", "staged_calls", "block_allocations")},
        }

    return {
        "request_made": run(fresh, True),
        "made_before": run(reuse, True),
        "outside_request": run(fresh, False),
        "request_made_again": run(fresh, True),
        "pool_requests": pool.requests,
        "pools_made": mem_pool.MemPool.made,
        "active_after": pool.active,
    }
