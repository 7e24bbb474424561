# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What each gloo rank runs for the persistent-collectives tests: every kind, plain (the oracle) and staged."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
WATCHED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
    "barrier",
)


_blocks: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()


def _remember_blocks() -> None:
    """From this module's import on, every block ``collective_workspaces`` allocates in this rank is remembered."""
    from vllm_omni.distributed import collective_workspaces

    allocate = collective_workspaces.allocate_bytes

    def allocate_and_remember(*args: Any, **kwargs: Any) -> torch.Tensor:
        block = allocate(*args, **kwargs)
        _blocks[block.data_ptr()] = block.untyped_storage()
        return block

    collective_workspaces.allocate_bytes = allocate_and_remember


def is_persistent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a live block allocated since this module was imported."""
    storage = tensor.untyped_storage()
    return _blocks.get(storage.data_ptr()) is storage


_remember_blocks()


class BackendRecorder:
    """Test-only: in this rank, records the storages ``torch.distributed``'s collectives are handed, per request.

    A call is unmanaged where it hands the backend anything but persistent blocks, or is a barrier or a list
    gather (XCCL makes temporaries of its own for those).
    """

    def __init__(self) -> None:
        self.requests: list[list[tuple[str, list[tuple[int, bool]]]]] = [[]]
        self._saved: dict[str, Callable] = {}
        self._depth = 0

    def __enter__(self) -> BackendRecorder:
        for name in WATCHED:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._recording(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        if not self.requests[-1]:
            self.requests.pop()

    def _recording(self, name: str, original: Callable) -> Callable:
        @torch._dynamo.disable
        def record(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # torch's all_gather_into_tensor calls all_gather_single: one call
                values = [*args, *kwargs.values()]
                flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
                tensors = [getattr(v, "tensor", v) for v in flat if isinstance(getattr(v, "tensor", v), torch.Tensor)]
                handed = [(t.untyped_storage().data_ptr(), is_persistent(t)) for t in tensors]
                self.requests[-1].append((name, handed))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return record

    def end_request(self) -> None:
        self.requests.append([])

    @staticmethod
    def fresh_across(recorders: list[BackendRecorder]) -> int:
        """Storages the last recorder's calls handed the backend that no earlier one did."""
        seen = {ptr for r in recorders[:-1] for calls in r.requests for _, tensors in calls for ptr, _ in tensors}
        last = {ptr for calls in recorders[-1].requests for _, tensors in calls for ptr, _ in tensors}
        return len(last - seen)

    def summary(self) -> list[dict[str, int]]:
        seen: set[int] = set()
        rows = []
        for calls in self.requests:
            handed = {ptr for _, tensors in calls for ptr, _ in tensors}
            unmanaged = [
                name
                for name, tensors in calls
                if name in ("barrier", "all_gather") or not tensors or not all(p for _, p in tensors)
            ]
            rows.append({"calls": len(calls), "fresh": len(handed - seen), "unmanaged": len(unmanaged)})
            seen |= handed
        return rows


SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"


def run_switched(
    switch: str, module: Callable, inputs: list[torch.Tensor], compiled: bool = False
) -> tuple[list[bytes], dict[str, int] | None]:
    """``module`` on each input in inference mode with the switch set: the results' bits and the recorded calls.
    A process stages or not for its life, and compiled code reads it once: a compiled ``module`` compiles again.
    Compiled with staging off, its collectives are torch's functional ones, which call no Python function a
    recorder could stand in for: nothing is recorded (None)."""
    os.environ[SWITCH_ENV] = switch
    torch._dynamo.reset()
    recorder = BackendRecorder() if switch != "0" or not compiled else contextlib.nullcontext()
    with torch.inference_mode(), recorder:
        results = [bits(module(x)) for x in inputs]
    if not isinstance(recorder, BackendRecorder):
        return results, None
    (request,) = recorder.summary()
    return results, request


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Values that differ per rank, call and element, and whose float sums are not exact in low precision."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3.7).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=generator, dtype=dtype)


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def close_floats(first: list[bytes], second: list[bytes], rtol: float = 1e-5) -> bool:
    """Whether float32 results given as ``bits`` agree to ``rtol``: what Inductor keeps where it fuses the code around
    torch's functional collectives otherwise than around registered ops."""
    as_floats = [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in (*first, *second)]
    pairs = zip(as_floats[: len(first)], as_floats[len(first) :], strict=True)
    return len(first) == len(second) and all(torch.allclose(a, b, rtol=rtol, atol=rtol) for a, b in pairs)


def kinds(rank: int, world: int, dtype: torch.dtype, salt: int) -> dict[str, Callable[[Any], list[torch.Tensor]]]:
    """Each kind as ``run(collectives) -> tensors to compare`` (results, then inputs that must stay untouched)."""
    group = dist.group.WORLD
    splits = [1 + (rank + peer) % 3 for peer in range(world)]  # what this rank sends to each peer
    received = [1 + (peer + rank) % 3 for peer in range(world)]

    def all_reduce(op):
        def run(collectives):
            tensor = data(rank, (5, 7), dtype, salt).t()  # a transposed view: the caller's layout is kept
            return [collectives.all_reduce(tensor, group, op)]

        return run

    def all_gather_into_tensor(collectives):
        tensor = data(rank, (3, 4), dtype, salt)
        output = torch.empty(world * 3, 4, dtype=dtype)
        return [collectives.all_gather_into_tensor(output, tensor, group), tensor]

    def broadcast(collectives):
        tensor = data(rank, (6, 2), dtype, salt)
        return [collectives.broadcast(tensor, world - 1, group)]

    def all_to_all_even(collectives):
        tensor = data(rank, (world * 2, 3), dtype, salt)
        output = torch.empty_like(tensor)
        return [collectives.all_to_all_single(output, tensor, group), tensor]

    def all_to_all_uneven(collectives):
        tensor = data(rank, (sum(splits), 2), dtype, salt)
        output = torch.empty(sum(received), 2, dtype=dtype)
        return [collectives.all_to_all_single(output, tensor, group, received, splits), tensor]

    def ring_batch(collectives):
        send = data(rank, (4, 3), dtype, salt)
        recv = torch.full((4, 3), 7, dtype=dtype)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world, group),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world, group),
        ]
        for work in collectives.batch_isend_irecv(ops):
            work.wait()
        return [recv, send]

    def list_gather(collectives):
        # a list of outputs, as managed_distributed's all_gather hands it on (Ulysses calls that one)
        tensor = data(rank, (2, 5), dtype, salt)
        outputs = [torch.empty(2, 5, dtype=dtype) for _ in range(world)]
        collectives.all_gather_into_tensor(outputs, tensor, group)
        return [*outputs, tensor]

    def reduce_scatter(collectives):
        tensor = data(rank, (world * 3, 2), dtype, salt)
        output = torch.empty(3, 2, dtype=dtype)
        return [collectives.reduce_scatter_tensor(output, tensor, group), tensor]

    return {
        "all_reduce_sum": all_reduce(dist.ReduceOp.SUM),
        "all_reduce_max": all_reduce(dist.ReduceOp.MAX),
        "all_gather_into_tensor": all_gather_into_tensor,
        "broadcast": broadcast,
        "all_to_all_even": all_to_all_even,
        "all_to_all_uneven": all_to_all_uneven,
        "ring_batch": ring_batch,
        "list_gather": list_gather,
        "reduce_scatter": reduce_scatter,
    }


def _log_lines(logger_name: str) -> list[str]:
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(logger_name).addHandler(handler)
    return lines


def checks(rank: int, world: int) -> dict[str, Any]:
    """Bits against the plain oracle; what the backend is handed; aliasing; barrier; fallbacks on one rank."""
    from vllm_omni.distributed import persistent_collectives as pc

    torch.set_num_threads(1)
    plain, staged = pc.Collectives(persistent=False), pc.Collectives(persistent=True)
    report: dict[str, Any] = {"equal": {}, "aliases": []}
    recorder = BackendRecorder()
    with recorder:
        for salt in range(3):  # three "requests": fresh caller tensors each time, blocks from the first on
            for dtype in DTYPES:
                expected = {name: run(plain) for name, run in kinds(rank, world, dtype, salt).items()}
                for name, run in kinds(rank, world, dtype, salt).items():
                    got = run(staged)
                    key = f"{name}/{dtype}"
                    report["equal"][key] = report["equal"].get(key, True) and [bits(t) for t in got] == [
                        bits(t) for t in expected[name]
                    ]
                    report["aliases"] += [key for t in got if is_persistent(t)]
            recorder.end_request()
    # The plain half of each request hands the backend caller tensors; the staged half only blocks. Count both.
    report["requests"] = recorder.summary()
    report["stats"] = staged.stats()

    # Staged only, three requests: the backend sees the blocks of request 1 again and nothing else.
    staged_only = BackendRecorder()
    with staged_only:
        for salt in range(3):
            for run in kinds(rank, world, torch.float32, salt).values():
                run(staged)
            staged.barrier(None, torch.device("cpu"))
            staged_only.end_request()
    report["staged_only"] = staged_only.summary()
    report["allocations_after_request_1"] = staged.stats()["block_allocations"] - report["stats"]["block_allocations"]

    # A barrier holds every rank until the last arrives.
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        time.sleep(0.5)
    staged.barrier(None, torch.device("cpu"))
    report["barrier_waited_s"] = time.monotonic() - start
    report["fallback"] = fallback_on_rank_one(rank, world)
    return report


def fallback_on_rank_one(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's allocator fails: it runs the plain collectives on its own tensors, its peers stage, none hangs."""
    from vllm_omni.distributed import collective_workspaces
    from vllm_omni.distributed import persistent_collectives as pc

    warnings = _log_lines(pc.logger.name)
    staged = pc.Collectives(persistent=True)
    real = collective_workspaces.allocate_bytes

    def failing(nbytes, device, group=None):
        raise RuntimeError(f"injected: no memory for {nbytes} bytes")

    if rank == 1:
        collective_workspaces.allocate_bytes = failing
    try:
        results = [run(staged) for run in kinds(rank, world, torch.float32, 7).values()]
        staged.barrier(None, torch.device("cpu"))
    finally:
        collective_workspaces.allocate_bytes = real
    expected = [run(pc.Collectives(persistent=False)) for run in kinds(rank, world, torch.float32, 7).values()]
    return {
        "equal": [[bits(t) for t in got] for got in results] == [[bits(t) for t in want] for want in expected],
        "fallbacks": staged.fallbacks,
        "warnings": warnings,
    }


def busy_block(rank: int, world: int) -> dict[str, Any]:
    """A call that finds its block in use runs on the caller's tensors: same bits, nothing overwritten."""
    from vllm_omni.distributed import persistent_collectives as pc

    staged = pc.Collectives(persistent=True)
    tensor = data(rank, (8,), torch.float32)
    staged.all_reduce(tensor.clone(), None)
    (block,) = staged.blocks()
    block.busy = True
    before = block.block.clone()
    got = staged.all_reduce(tensor.clone(), None)
    want = pc.Collectives(persistent=False).all_reduce(tensor.clone(), None)
    return {
        "equal": bits(got) == bits(want),
        "block_kept": torch.equal(before, block.block),
        "fallbacks": staged.fallbacks,
    }
