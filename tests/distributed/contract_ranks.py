# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the contract tests: the staged collectives beside the plain ones where they used to
depart (batches in flight, a group this rank is not in, the batch's work), capped blocks, and streams."""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed.collective_ranks import bits, data

CAP_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES_MAX_BLOCK_MIB"
MIB = 1 << 20


def _ring_ops(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, group: Any = None):
    return [
        dist.P2POp(dist.isend, send, (rank + 1) % world, group),
        dist.P2POp(dist.irecv, recv, (rank - 1) % world, group),
    ]


def _batches_beside_plain(run, requests: int) -> dict[str, Any]:
    """``run`` with torch's batches, then ``requests`` times staged: whether each equals plain, and the pool's cost."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    staged = ModuleCollectives(persistent=True)
    plain, _ = run(dist.batch_isend_irecv)
    got = [run(staged.batch_isend_irecv) for _ in range(requests)]
    return {
        "equal": all(result == plain for result, _ in got),
        "slowest_s": max(seconds for _, seconds in got),
        "fallbacks": staged.fallbacks,
        "blocks": len(staged.blocks()),
        "allocations": staged.stats()["block_allocations"],
    }


def batches_in_flight(rank: int, world: int) -> dict[str, Any]:
    """Each rank posts its send and its receive as two batches before waiting either: the receive that matches a
    peer's first batch is in this rank's second. Torch posts both at once; so must the staged batch."""

    def run(batch_isend_irecv) -> tuple[list[bytes], float]:
        send, recv = data(rank, (64, 3), torch.float32), torch.zeros(64, 3)
        start = time.monotonic()
        sends = batch_isend_irecv([dist.P2POp(dist.isend, send, (rank + 1) % world)])
        receives = batch_isend_irecv([dist.P2POp(dist.irecv, recv, (rank - 1) % world)])
        for work in (*sends, *receives):
            work.wait()
        return [bits(recv), bits(send)], time.monotonic() - start

    return _batches_beside_plain(run, requests=3)  # three "requests": the pool's blocks are reused


def abandoned_batches(rank: int, world: int) -> dict[str, Any]:
    """Batches nobody waits for yet keep their blocks and the pool grows past them: later batches never wait on one
    (its match may come only after them). Waited at last, each lands the plain bits; later batches reuse the pool."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    staged = ModuleCollectives(persistent=True)
    dropped = [(data(rank, (4, 3), torch.float32, salt), torch.zeros(4, 3)) for salt in range(9)]
    works = [staged.batch_isend_irecv(_ring_ops(rank, world, send, recv)) for send, recv in dropped]
    posted = len(staged.blocks())
    waited = []
    for salt in (100, 101):
        mine, theirs = data(rank, (4, 3), torch.float32, salt), torch.zeros(4, 3)
        for work in staged.batch_isend_irecv(_ring_ops(rank, world, mine, theirs)):
            work.wait()
        waited.append(bits(theirs) == bits(data((rank - 1) % world, (4, 3), torch.float32, salt)))
    before_wait = [bits(recv) == bits(data((rank - 1) % world, (4, 3), torch.float32, salt)) for salt, (_, recv) in
                   enumerate(dropped)]  # fmt: skip
    for work in (work for batch in works for work in batch):
        work.wait()
    landed = [bits(recv) == bits(data((rank - 1) % world, (4, 3), torch.float32, salt)) for salt, (_, recv) in
              enumerate(dropped)]  # fmt: skip
    allocations = staged.stats()["block_allocations"]
    for send, recv in dropped:  # a second "request" as deep as the first: the pool holds it
        for work in staged.batch_isend_irecv(_ring_ops(rank, world, send, recv)):
            work.wait()
    return {
        "waited_equal": all(waited),
        "fallbacks": staged.fallbacks,
        "blocks": (posted, len(staged.blocks())),
        "landed_before_wait": before_wait,
        "landed": landed,
        "new_allocations_in_request_2": staged.stats()["block_allocations"] - allocations,
    }


def deep_ring(rank: int, world: int) -> dict[str, Any]:
    """Twelve ring batches posted, then waited in order, as torch allows: every rank's receives equal plain gloo's
    at once. Finishing an older batch before posting a newer one would stall until the group timeout."""

    def run(batch_isend_irecv) -> tuple[list[bytes], float]:
        sends = [data(rank, (3, 2), torch.float32, salt) for salt in range(12)]
        receives = [torch.zeros(3, 2) for _ in sends]
        start = time.monotonic()
        works = [batch_isend_irecv(_ring_ops(rank, world, s, r)) for s, r in zip(sends, receives, strict=True)]
        for work in (work for batch in works for work in batch):
            work.wait()
        return [bits(t) for t in receives + sends], time.monotonic() - start

    return _batches_beside_plain(run, requests=2)


_GLOO_STAMP = re.compile(r"\[F[0-9]{4} [0-9:.]+ ")  # gloo's check failures carry a timestamp


def _outcome(call: Callable, *args: Any) -> str:
    """``ok``, or the error's type and message."""
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001 - compared: the staged call must raise what the plain one raises
        return f"{type(error).__name__}: {_GLOO_STAMP.sub('[F ', str(error))}"
    return "ok"


def _bits_list(result: torch.Tensor | list[torch.Tensor]) -> list[bytes]:
    return [bits(t) for t in (result if isinstance(result, list) else [result])]


def error_paths(rank: int, world: int) -> dict[str, Any]:
    """Calls plain gloo refuses, staged beside it: the same error on every rank, and then the call of that kind
    still lands in the block the one before the error used: no fallback, no new allocation, the plain bits."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    group, small, chunked = dist.group.WORLD, 5, MIB // 8 + 3  # float32 per rank: above a 1 MiB cap once gathered

    def gather(numel: int, out_numel: int) -> Callable:
        return lambda c: c.all_gather_into_tensor(torch.empty(out_numel), data(rank, (numel,), torch.float32), group)

    def listed(sizes: list[int]) -> Callable:
        return lambda c: c.all_gather_into_tensor(
            [torch.empty(n) for n in sizes], data(rank, (small,), torch.float32), group
        )

    def to_all(per_peer: int, out_numel: int) -> Callable:
        return lambda c: c.all_to_all_single(
            torch.empty(out_numel), data(rank, (world * per_peer,), torch.float32), group
        )

    def scatter(out_numel: int) -> Callable:
        return lambda c: c.reduce_scatter_tensor(
            torch.empty(out_numel), data(rank, (world * small,), torch.float32), group
        )

    def broadcast(src: int) -> Callable:
        return lambda c: c.broadcast(data(rank, (small,), torch.float32), src, group)

    cases = {  # name: (a call the kind accepts, a call plain gloo refuses)
        "gather_short": (gather(small, world * small), gather(small, world * small - 1)),
        "gather_long": (gather(small, world * small), gather(small, world * small + 1)),
        "gather_chunked_short": (gather(chunked, world * chunked), gather(chunked, world * chunked - 1)),
        "list_too_short": (listed([small] * world), listed([small] * (world - 1))),
        "list_too_long": (listed([small] * world), listed([small] * (world + 1))),
        "list_entry_short": (listed([small] * world), listed([small] * (world - 1) + [small - 1])),
        "all_to_all_long": (to_all(2 * small, world * 2 * small), to_all(small, world * small + world)),
        "all_to_all_chunked_short": (to_all(chunked, world * chunked), to_all(chunked, world * (chunked - 1))),
        "reduce_scatter_short": (scatter(small), scatter(small - 1)),
        "broadcast_bad_src": (broadcast(0), broadcast(world)),
    }
    plain, report = ModuleCollectives(persistent=False), {}
    for name, (good, bad) in cases.items():
        staged = ModuleCollectives(persistent=True)
        good(staged)
        before = ([b.data_ptr for b in staged.blocks()], staged.stats()["block_allocations"])
        outcomes = (_outcome(bad, plain), _outcome(bad, staged))
        busy = [b.busy for b in staged.blocks()]
        equal = _bits_list(good(staged)) == _bits_list(good(plain))
        after = ([b.data_ptr for b in staged.blocks()], staged.stats()["block_allocations"])
        report[name] = {"plain": outcomes[0], "staged": outcomes[1], "busy_after_error": busy, "equal": equal,
                        "same_block": before == after, "fallbacks": staged.fallbacks}  # fmt: skip
    return report


def _every_kind(rank: int, world: int, dtype: torch.dtype, salt: int, group: Any = None) -> dict[str, Callable]:
    """``run(collectives, out) -> outputs`` for each kind on ``group``, whose outputs are ``out(shape)``."""

    def inputs(shape: tuple[int, ...]) -> torch.Tensor:
        return data(rank, shape, dtype, salt)

    def batch(c, out):
        recv = out((3, 2))
        for work in c.batch_isend_irecv(_ring_ops(rank, world, inputs((3, 2)), recv, group)):
            work.wait()
        return [recv]

    return {
        "all_reduce": lambda c, out: [c.all_reduce(_filled(out((4, 2)), inputs((4, 2))), group)],
        "broadcast": lambda c, out: [c.broadcast(_filled(out((4, 2)), inputs((4, 2))), 0, group)],
        "all_gather_into_tensor": lambda c, out: [c.all_gather_into_tensor(out((world * 2, 3)), inputs((2, 3)), group)],
        "list_gather": lambda c, out: c.all_gather_into_tensor(
            [out((2, 3)) for _ in range(world)], inputs((2, 3)), group
        ),
        "all_to_all_single": lambda c, out: [c.all_to_all_single(out((world * 2,)), inputs((world * 2,)), group)],
        "reduce_scatter_tensor": lambda c, out: [c.reduce_scatter_tensor(out((2,)), inputs((world * 2,)), group)],
        "batch_isend_irecv": batch,
    }


def _filled(output: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``output`` holding ``values``, written outside autograd: an in-place collective's input is its output."""
    with torch.no_grad():
        return output.copy_(values)


def _bits_of(run: Callable, collectives: Any, out: Callable, inference: bool) -> list[bytes]:
    with torch.inference_mode(inference):
        return [bits(t.detach()) for t in run(collectives, out)]


def inference_mode_blocks(rank: int, world: int) -> dict[str, Any]:
    """Each kind staged inside ``torch.inference_mode()``, then outside it, then inside again, beside plain: blocks
    first used in one mode are written in the other. Two dtypes, as a list gather of float16 failed alike."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    plain, staged, report = ModuleCollectives(persistent=False), ModuleCollectives(persistent=True), {}
    for dtype in (torch.float32, torch.float16):
        out = functools.partial(torch.zeros, dtype=dtype)
        for salt, inference in enumerate((True, False, True)):
            for name, run in _every_kind(rank, world, dtype, salt).items():
                results = []
                for collectives in (plain, staged):
                    try:
                        results.append(_bits_of(run, collectives, out, inference))
                    except Exception as error:  # noqa: BLE001 - reported: plain returns, so must the staged call
                        results.append(f"{type(error).__name__}: {error}")
                report.setdefault(f"{name}/{dtype}", []).append({"inference": inference, "results": results})
    equal = {key: all(r["results"][0] == r["results"][1] for r in rows) for key, rows in report.items()}
    failed = {key: [r["results"] for r in rows if isinstance(r["results"][1], str)] for key, rows in report.items()}
    return {"equal": equal, "failed": {k: v for k, v in failed.items() if v}, "fallbacks": staged.fallbacks}


def grad_outputs(rank: int, world: int) -> dict[str, Any]:
    """Outputs autograd guards (a leaf that requires grad, a view of one), staged beside plain: each kind accepts
    or refuses them as plain gloo does, with its bits where it accepts. Each call gets a group of its own: gloo
    raises some refusals again at the group's next call, and a group that refused once is never used again."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    def view_of_leaf(shape):
        return torch.zeros((2, *shape), requires_grad=True)[0]

    report = {}
    for how, out in (("leaf", functools.partial(torch.zeros, requires_grad=True)), ("view_of_leaf", view_of_leaf)):
        for name in _every_kind(rank, world, torch.float32, 0):
            results = []
            for collectives in (ModuleCollectives(persistent=False), ModuleCollectives(persistent=True)):
                run = _every_kind(rank, world, torch.float32, 0, dist.new_group(list(range(world))))[name]
                try:
                    results.append(_bits_of(run, collectives, out, False))
                except Exception as error:  # noqa: BLE001 - compared with plain's
                    results.append(f"{type(error).__name__}: {error}")
                dist.barrier()  # on the default group, which saw no refusal: every rank done before the next call
            report[f"{name}/{how}"] = {"plain": results[0], "staged": results[1]}
    return report


def batch_work(rank: int, world: int) -> dict[str, Any]:
    """What a caller of torch's batch may ask of its work, asked of the staged batch's and of plain gloo's."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    def ask(batch_isend_irecv, how: str) -> dict[str, Any]:
        send, recv = data(rank, (5, 2), torch.float32), torch.zeros(5, 2)
        works = batch_isend_irecv(_ring_ops(rank, world, send, recv))
        pending = [work.is_completed() for work in works]  # gloo completes a point-to-point work once waited
        try:
            for work in works:
                work.get_future().wait() if how == "future" else work.wait(timeout=timedelta(seconds=60))
        except RuntimeError as error:  # gloo's point-to-point works have no future: the staged batch's neither
            for work in works:
                work.wait()
            return {"raised": str(error)}
        return {
            "received": bits(recv) == bits(data((rank - 1) % world, (5, 2), torch.float32)),
            "completed": (any(pending), all(work.is_completed() for work in works)),
            "exception": [work.exception() for work in works if work.exception() is not None],
        }

    staged = ModuleCollectives(persistent=True)
    report = {}
    for how in ("wait", "future"):
        report[how] = {"plain": ask(dist.batch_isend_irecv, how), "staged": ask(staged.batch_isend_irecv, how)}
    report["fallbacks"] = staged.fallbacks
    return report


def non_member(rank: int, world: int) -> dict[str, Any]:
    """A collective on a group this rank is not in: torch warns and returns, the tensors untouched."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    pair = dist.new_group([0, 1])
    report: dict[str, Any] = {}
    for name, collectives in (("plain", ModuleCollectives(persistent=False)), ("staged", ModuleCollectives(True))):
        tensors = [data(rank, (2, 4), torch.float32, salt) for salt in range(4)]
        kept = [bits(t) for t in tensors]
        outcome = "ok"
        try:
            collectives.all_reduce(tensors[0], pair)
            collectives.broadcast(tensors[1], 0, pair)
            collectives.all_gather_into_tensor(torch.zeros(4, 4), tensors[2], pair)
            collectives.all_to_all_single(torch.zeros(2, 4), tensors[3], pair)
            collectives.barrier(pair, torch.device("cpu"))
        except Exception as error:  # noqa: BLE001 - reported: the staged one must do what the plain one does
            outcome = f"{type(error).__name__}: {error}"
        report[name] = {"outcome": outcome, "untouched": [bits(t) for t in tensors] == kept}
    dist.barrier()
    return report


def capped_blocks(rank: int, world: int) -> dict[str, Any]:
    """Calls of several MiB through blocks capped at 1 MiB, each kind beside the plain collective."""
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    os.environ[CAP_ENV] = "1"
    group = dist.group.WORLD
    per_peer = (3 * MIB) // (4 * world) + 5  # elements: a last chunk shorter than the others

    def kinds(salt: int) -> dict[str, Any]:
        return {
            "broadcast": lambda c: [c.broadcast(data(rank, (3 * MIB // 4 + 7,), torch.float32, salt), 1, group)],
            "all_gather": lambda c: [
                c.all_gather_into_tensor(
                    torch.empty(world * (MIB // 4 + 3), dtype=torch.float32),
                    data(rank, (MIB // 4 + 3,), torch.float32, salt),
                    group,
                )
            ],
            "all_to_all": lambda c: [
                c.all_to_all_single(
                    torch.empty(world * per_peer, dtype=torch.float32),
                    data(rank, (world * per_peer,), torch.float32, salt),
                    group,
                )
            ],
            "all_reduce_int": lambda c: [c.all_reduce(data(rank, (3 * MIB // 8 + 1,), torch.int64, salt), group)],
            "list_gather": lambda c: c.all_gather_into_tensor(
                [torch.empty(MIB // 8 + 1, dtype=torch.bfloat16) for _ in range(world)],
                data(rank, (MIB // 8 + 1,), torch.bfloat16, salt),
                group,
            ),
        }

    plain, staged = ModuleCollectives(persistent=False), ModuleCollectives(persistent=True)
    report: dict[str, Any] = {"equal": {}}
    for salt in range(2):
        for name, run in kinds(salt).items():
            same = [bits(t) for t in run(staged)] == [bits(t) for t in run(plain)]
            report["equal"][name] = report["equal"].get(name, True) and same
    report["chunked_calls"] = staged.chunked_calls
    report["resident_bytes"] = staged.stats()["resident_bytes"]
    report["allocations"] = staged.stats()["block_allocations"]

    # A floating-point sum on more than two ranks: chunks would change its bits, so it is staged whole.
    tensor = data(rank, (3 * MIB // 4,), torch.float32)
    whole = staged.all_reduce(tensor.clone(), group)
    report["float_equal"] = bits(whole) == bits(plain.all_reduce(tensor.clone(), group))
    chunked = torch.cat([plain.all_reduce(part.clone(), group) for part in tensor.split(MIB // 4)])
    report["chunks_would_differ"] = bits(chunked) != bits(whole)
    report["float_resident_bytes"] = staged.stats()["resident_bytes"]
    return report


def capped_fallback(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 gets no block: it runs the same chunks on its own tensors, so its peers' chunked calls still match."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed.module_collectives import ModuleCollectives

    os.environ[CAP_ENV] = "1"

    def failing(nbytes, device, group=None):
        raise RuntimeError(f"injected: no memory for {nbytes} bytes")

    real = collective_workspaces.allocate_bytes
    if rank == 1:
        collective_workspaces.allocate_bytes = failing
    staged, plain = ModuleCollectives(persistent=True), ModuleCollectives(persistent=False)
    calls = {
        "broadcast": lambda c: c.broadcast(data(rank, (MIB // 2 + 1,), torch.float32), 0, None),
        "all_gather": lambda c: c.all_gather_into_tensor(
            torch.empty(world * MIB // 8), data(rank, (MIB // 8,), torch.float32), None
        ),
        "all_to_all": lambda c: c.all_to_all_single(
            torch.empty(world * MIB // 8), data(rank, (world * MIB // 8,), torch.float32), None
        ),
        "all_reduce_int": lambda c: c.all_reduce(data(rank, (MIB // 4,), torch.int64), None),
    }
    try:
        equal = all(bits(call(staged)) == bits(call(plain)) for call in calls.values())
    finally:
        collective_workspaces.allocate_bytes = real
    return {"equal": equal, "fallbacks": staged.fallbacks}


def four_rank_checks(rank: int, world: int) -> dict[str, Any]:
    """The four-rank checks in one start of the ranks (each start costs seconds of imports), the cap set first: it
    is read once per process. Batches left in flight come last."""
    os.environ[CAP_ENV] = "1"
    checks = (non_member, capped_blocks, capped_fallback, *DEFECTS, abandoned_batches)
    return {check.__name__: check(rank, world) for check in checks}


def three_rank_checks(rank: int, world: int) -> dict[str, Any]:
    os.environ[CAP_ENV] = "1"
    checks = (batches_in_flight, batch_work, *DEFECTS)
    return {check.__name__: check(rank, world) for check in checks}


DEFECTS = (
    error_paths,
    deep_ring,
    inference_mode_blocks,
    grad_outputs,
)  # on three ranks and on four
