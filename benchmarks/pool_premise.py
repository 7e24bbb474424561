# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""Pool mode's premise, checked on one card in under a minute, before anyone serves a model: a private pool's
segments keep their addresses through ``empty_cache()`` and the allocator's retry after a failed allocation.

    python -m benchmarks.pool_premise --device xpu     # or xpu:N; cuda: its caching allocator has the same design

It makes the pool as a diffusion worker does (``request_pool.RequestPool``, the device named), runs a few synthetic
requests inside it that allocate, free and call ``empty_cache()`` as offload does, then one that fills the card to
force the allocator's retry, and prints whether the pool's segments survived, whether request 2 added a segment, and
what stayed reserved; the same requests outside a pool beside them, as the contrast. Exit status 0 where the
premise holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from typing import Any

import torch

from vllm_omni.distributed.request_pool import RequestPool, refuse_expandable_segments
from xpu_collective_memory.overlay import running

MIB = 1 << 20


class DeviceAllocator:
    """What the check needs of a device's caching allocator, from ``torch.xpu`` or ``torch.cuda``."""

    def __init__(self, device: str) -> None:
        device_type, _, index = device.partition(":")
        self.module = getattr(torch, device_type)
        self.device = torch.device(device_type, int(index) if index else self.module.current_device())
        self.module.set_device(self.device)
        self.out_of_memory = torch.OutOfMemoryError

    def empty(self, nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def segments(self, pool: RequestPool | None) -> list[tuple[int, int]]:
        """The pool's segments, or the default pool's (``None``), as (address, bytes)."""
        rows = pool.snapshot() if pool is not None else self.module.memory_snapshot()
        if pool is None:
            rows = [s for s in rows if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
        mine = [s for s in rows if s.get("device", self.device.index) == self.device.index]
        return sorted((s["address"], s["total_size"]) for s in mine)

    def reserved(self) -> int:
        return self.module.memory_reserved(self.device)

    def retries(self) -> int:
        return self.module.memory_stats(self.device).get("num_alloc_retries", 0)

    def capacity(self) -> int:
        return self.module.get_device_properties(self.device).total_memory


def one_request(allocator: Any, mib: int) -> None:
    """A request's pattern: activations of a few sizes, some freed early, ``empty_cache()`` between components."""
    kept = [allocator.empty(mib * MIB), allocator.empty(mib * MIB // 2)]
    for step in range(3):
        scratch = [allocator.empty(mib * MIB // (step + 2)) for _ in range(2)]
        del scratch
        allocator.empty_cache()  # as model-level offload does at every component switch
    del kept


def run_arm(allocator: Any, pool: RequestPool | None, requests: int, mib: int) -> list[dict[str, Any]]:
    """Per request: the segments when it ends, and after the ``empty_cache()`` that follows it."""
    rows = []
    for _ in range(requests):
        with pool.request() if pool is not None else contextlib.nullcontext():
            one_request(allocator, mib)
        ended = allocator.segments(pool)
        allocator.empty_cache()  # between requests
        rows.append({"ended": ended, "segments": allocator.segments(pool), "reserved": allocator.reserved()})
    return rows


def fill(allocator: Any, pool: RequestPool, chunk_mib: int) -> dict[str, Any]:
    """Inside the pool, allocate until the card is full: the allocator retries (releasing what it may) first."""
    before, held, raised = allocator.retries(), [], False
    with pool.request():
        try:
            for _ in range(allocator.capacity() // (chunk_mib * MIB) + 2):
                held.append(allocator.empty(chunk_mib * MIB))
        except allocator.out_of_memory:
            raised = True
        chunks = len(held)
        held.clear()
    allocator.empty_cache()
    return {"out_of_memory": raised, "retries": allocator.retries() - before, "chunks": chunks,
            "reserved_after_MiB": allocator.reserved() / MIB}  # fmt: skip


def verdict(pool_rows: list[dict], default_rows: list[dict], after_fill: list[tuple[int, int]]) -> dict[str, Any]:
    first = set(map(tuple, pool_rows[0]["ended"]))
    later = [set(map(tuple, row[key])) for row in pool_rows for key in ("ended", "segments")] + [set(after_fill)]
    return {
        "pool_segments": len(first),
        "pool_segments_survived": bool(first) and all(first <= seen for seen in later),
        "request_2_added_a_segment": bool(set(map(tuple, pool_rows[1]["ended"])) - first),
        "pool_reserved_MiB": [row["reserved"] / MIB for row in pool_rows],
        "default_segments_left_after_empty_cache": [len(row["segments"]) for row in default_rows],
        "default_reserved_MiB": [row["reserved"] / MIB for row in default_rows],
    }


def check(allocator: Any, api: Any, requests: int = 3, mib: int = 256, chunk_mib: int = 1024) -> dict[str, Any]:
    refuse_expandable_segments(allocator.device.type)
    default_rows = run_arm(allocator, None, requests, mib)  # the contrast first: the pool's memory is then its own
    pool = RequestPool(api, allocator.device)
    pool_rows = run_arm(allocator, pool, requests, mib)
    filled = fill(allocator, pool, chunk_mib)
    result = verdict(pool_rows, default_rows, allocator.segments(pool))
    result["fill"] = filled
    result["holds"] = result["pool_segments_survived"] and not result["request_2_added_a_segment"]
    result["running"] = f"{running()}, torch {torch.__version__}"
    return result


def format_result(result: dict[str, Any], device: str) -> str:
    lines = [
        f"pool premise on {device}: {'HOLDS' if result['holds'] else 'DOES NOT HOLD'} ({result['running']})",
        f"  the pool's {result['pool_segments']} segments of request 1 kept their addresses through empty_cache() "
        f"and the fill: {result['pool_segments_survived']}",
        f"  request 2 added a segment to the pool: {result['request_2_added_a_segment']}",
        f"  reserved after each request, in the pool: {result['pool_reserved_MiB']} MiB",
        f"  outside a pool (the contrast): default-pool segments left after empty_cache() "
        f"{result['default_segments_left_after_empty_cache']}, reserved {result['default_reserved_MiB']} MiB",
        f"  fill inside the pool: out of memory {result['fill']['out_of_memory']} after {result['fill']['chunks']} "
        f"chunks, allocator retries {result['fill']['retries']}, reserved after it "
        f"{result['fill']['reserved_after_MiB']:.0f} MiB (the pool keeps what it took)",
    ]
    return "\n".join(lines)


DEVICE = re.compile(r"(xpu|cuda)(:\d+)?")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pool_premise",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Needs: an idle card (the check fills it to force the allocator's retry) and torch's MemPool (2.11 or "
        "later). Exit status: 0 where the premise holds, 1 where it does not, 2 on a bad argument.",
    )
    parser.add_argument(
        "--device",
        required=True,
        default=argparse.SUPPRESS,
        help="required: the card, xpu or cuda for the current one, xpu:N or cuda:N for card N",
    )
    parser.add_argument("--requests", type=int, default=3, help="synthetic requests per arm (at least 2)")
    parser.add_argument("--mib", type=int, default=256, help="the largest activation of a request, MiB")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not DEVICE.fullmatch(args.device):
        parser.error(f"--device={args.device!r}: expected xpu, cuda, xpu:N or cuda:N")
    if args.requests < 2 or args.mib < 1:
        parser.error(f"--requests={args.requests} --mib={args.mib}: expected at least 2 requests and 1 MiB")
    allocator = DeviceAllocator(args.device)
    result = check(allocator, allocator.module, args.requests, args.mib)
    print(json.dumps(result) if args.json else format_result(result, str(allocator.device)))
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
