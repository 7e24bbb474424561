# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What persistent collectives cost per call: the diffusion coordinator's all-reduce, staged and plain, beside
``torch.distributed.all_reduce`` itself, on gloo ranks.

Each rank times batches of all-reduces of one size for three callers back to back, in rotating order, every batch
started together behind a barrier: ``torch`` (``dist.all_reduce``), ``plain`` (``coordinator_all_reduce`` with
``VLLM_OMNI_PERSISTENT_COLLECTIVES=0``, what every platform pays once upstream) and ``staged`` (``=1``). Per rank and
size it reports wall and process-CPU time per call, and two paired differences per call with 95% bootstrap intervals
over the pairs: staged minus plain (the staging's own cost) and plain minus torch (the coordinator's routing). A
slowdown the scheduler puts on a whole round cancels in its differences. The ``_host`` callers run the same code with
``dist.all_reduce`` replaced by a no-op for the batch: the host time the callers add, free of the backend's thread
hand-off, which on one gloo rank lengthens with any work between calls. With more ranks than cores, a late rank
makes its peers wait, and that wake-up latency adds to the wall time of every caller.

    python -m benchmarks.persistent_collectives_overhead --world-size 1 --pairs 30   # host cost alone
    python -m benchmarks.persistent_collectives_overhead --world-size 4 --pairs 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import stats
from tests.distributed.ranks import results_or_raise, run_ranks

SIZES = {"1 KiB": 1 << 10, "64 KiB": 1 << 16, "4 MiB": 1 << 22}
CALLERS = ("torch", "plain", "staged", "torch_host", "plain_host", "staged_host")
COMPARISONS = (("staged", "plain"), ("plain", "torch"), ("staged_host", "plain_host"), ("plain_host", "torch_host"))
SWITCH_ENV = "VLLM_OMNI_PERSISTENT_COLLECTIVES"


CLOCKS = ("wall", "cpu", "caller")  # caller: this thread's CPU time, the host cost without gloo's own threads


def _time_batch(call, tensor, calls: int) -> tuple[float, float, float]:
    wall, cpu, caller = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(calls):
        call(tensor)
    ends = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - caller
    return tuple(end / calls for end in ends)


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def measure(rank: int, world: int, pairs: int, calls: int) -> dict[str, Any]:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from vllm_omni.distributed import persistent_collectives as pc
    from vllm_omni.distributed import request_collectives as rc

    torch.set_num_threads(1)
    # What coordinator_all_reduce reads of a GroupCoordinator; at least 2 ranks, so that one rank is not bypassed.
    coordinator = SimpleNamespace(world_size=max(world, 2), device_group=dist.group.WORLD)

    def switched(value: str):
        def call(tensor):
            rc.coordinator_all_reduce(coordinator, tensor)

        return value, call

    switches = {"torch": (None, dist.all_reduce), "plain": switched("0"), "staged": switched("1")}
    switches |= {f"{name}_host": value for name, value in switches.items()}
    real = dist.all_reduce
    samples: dict[str, Any] = {}
    for label, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        runs = {name: {clock: [] for clock in CLOCKS} for name in CALLERS}
        for pair in range(-1, pairs):  # round -1 warms every caller up and is not kept
            for name in CALLERS[pair % len(CALLERS) :] + CALLERS[: pair % len(CALLERS)]:
                value, call = switches[name]
                if value is not None:
                    os.environ[SWITCH_ENV] = value
                dist.barrier()
                if name.endswith("_host"):  # the backend stood in for by a no-op, for this batch only
                    dist.all_reduce = _no_op
                    call = _no_op if name == "torch_host" else call
                try:
                    times = _time_batch(call, tensor, calls)
                finally:
                    dist.all_reduce = real
                if pair >= 0:
                    for clock, seconds in zip(CLOCKS, times, strict=True):
                        runs[name][clock].append(seconds)
        samples[label] = runs
    os.environ[SWITCH_ENV] = "1"
    return {"rank": rank, "samples": samples, "layer": pc.collectives_for("cpu").stats()}


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for label in SIZES:
        per_rank = []
        for report in reports:
            runs = report["samples"][label]
            row: dict[str, Any] = {"rank": report["rank"]}
            for clock in CLOCKS:
                for name in CALLERS:
                    row[f"{clock}_{name}_us"] = 1e6 * sum(runs[name][clock]) / len(runs[name][clock])
                for high, low in COMPARISONS:
                    us = [1e6 * t for t in runs[high][clock]], [1e6 * t for t in runs[low][clock]]
                    row[f"{clock}_{high}_minus_{low}_us"] = stats.paired_difference(*us).as_dict()
                    ratio = stats.paired_ratio(runs[high][clock], runs[low][clock])
                    row[f"{clock}_{high}_over_{low}"] = ratio.as_dict()
            per_rank.append(row)
        summary[label] = per_rank
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for label, rows in summary.items():
        lines.append(f"all_reduce of {label} (float32), per call:")
        for row in rows:
            for clock in CLOCKS:
                times = ", ".join(f"{name} {row[f'{clock}_{name}_us']:.1f}" for name in CALLERS)
                parts = []
                for high, low in COMPARISONS:
                    extra = stats.Estimate(**row[f"{clock}_{high}_minus_{low}_us"])
                    ratio = stats.Estimate(**row[f"{clock}_{high}_over_{low}"])
                    parts.append(
                        f"{high} - {low} {stats.describe(extra, unit=' us', digits=1)}, ratio {stats.describe(ratio)}"
                    )
                lines.append(f"  rank {row['rank']} {clock} ({times} us): " + "; ".join(parts))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.persistent_collectives_overhead",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Needs: this checkout's CPU set-up; gloo ranks on this machine's cores, no card. Exit status: 0 when "
        "it measured, 2 on a bad argument.",
    )
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks")
    parser.add_argument("--pairs", type=int, default=30, help="paired batches per size")
    parser.add_argument("--calls", type=int, default=20, help="all-reduces per batch")
    parser.add_argument(
        "--output-dir", type=Path, default=Path("out/persistent_collectives_overhead"), help="results.json"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, least in (("world_size", 1), ("pairs", 2), ("calls", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= {least}")
    reports = results_or_raise(
        run_ranks(measure, args.world_size, args.pairs, args.calls, timeout_s=1800), args.world_size
    )
    summary = {
        "config": {**vars(args), "output_dir": str(args.output_dir), "cpu_count": os.cpu_count()},
        "per_call": summarize(reports),
        "layer": [r["layer"] for r in reports],
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"{args.world_size} gloo ranks on {os.cpu_count()} CPU core(s), {args.pairs} pairs of {args.calls} calls")
    print(format_summary(summary["per_call"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
