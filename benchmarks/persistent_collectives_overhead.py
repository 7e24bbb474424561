# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM-Omni project
"""What persistent collectives cost per call: staged all-reduces paired with plain ones, on gloo ranks.

Each rank times batches of all-reduces of one size, the plain collective and the staged one back to back in
rotating order, every batch started together behind a barrier. Per rank and size it reports the wall and
process-CPU time per call of both, their paired ratio and the paired difference per call, each with a 95%
bootstrap interval over the pairs: a slowdown the scheduler puts on both halves of a pair cancels. One rank
gives the staging's own host cost; with more ranks than cores, a rank that arrives later makes its peers wait,
and the wake-up latency of an oversubscribed machine adds to the wall time of both.

    python -m benchmarks.persistent_collectives_overhead --world-size 4 --pairs 30
    python -m benchmarks.persistent_collectives_overhead --world-size 1 --pairs 30   # host cost alone
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from minimax_h3_bench import stats
from minimax_h3_bench.ranks import results_or_raise, run_ranks

SIZES = {"1 KiB": 1 << 10, "64 KiB": 1 << 16, "4 MiB": 1 << 22}


def _time_batch(call, tensor, calls: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call(tensor)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def measure(rank: int, world: int, pairs: int, calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from vllm_omni.distributed.persistent_collectives import Collectives

    torch.set_num_threads(1)
    persistent = Collectives(persistent=True)

    def plain(tensor):
        dist.all_reduce(tensor)

    def staged(tensor):
        persistent.all_reduce(tensor, None)

    sync = dist.barrier
    samples: dict[str, Any] = {}
    for label, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        for warm in (plain, staged):
            warm(tensor)
        runs: dict[str, dict[str, list[float]]] = {"plain": {"wall": [], "cpu": []}, "staged": {"wall": [], "cpu": []}}
        for pair in range(pairs):
            order = (("plain", plain), ("staged", staged)) if pair % 2 == 0 else (("staged", staged), ("plain", plain))
            for name, call in order:
                sync()
                wall, cpu = _time_batch(call, tensor, calls)
                runs[name]["wall"].append(wall)
                runs[name]["cpu"].append(cpu)
        samples[label] = runs
    return {"rank": rank, "samples": samples, "layer": persistent.stats()}


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for label in SIZES:
        per_rank = []
        for report in reports:
            runs = report["samples"][label]
            row: dict[str, Any] = {"rank": report["rank"]}
            for clock in ("wall", "cpu"):
                staged, plain = runs["staged"][clock], runs["plain"][clock]
                row[f"{clock}_plain_us"] = 1e6 * sum(plain) / len(plain)
                row[f"{clock}_staged_us"] = 1e6 * sum(staged) / len(staged)
                row[f"{clock}_ratio"] = stats.paired_ratio(staged, plain).as_dict()
                row[f"{clock}_extra_us"] = stats.paired_difference([1e6 * s for s in staged], [1e6 * p for p in plain])
                row[f"{clock}_extra_us"] = row[f"{clock}_extra_us"].as_dict()
            per_rank.append(row)
        summary[label] = per_rank
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for label, rows in summary.items():
        lines.append(f"all_reduce of {label} (float32), staged / plain per call:")
        for row in rows:
            parts = []
            for clock in ("wall", "cpu"):
                ratio, extra = stats.Estimate(**row[f"{clock}_ratio"]), stats.Estimate(**row[f"{clock}_extra_us"])
                parts.append(
                    f"{clock} {row[f'{clock}_plain_us']:.1f} -> {row[f'{clock}_staged_us']:.1f} us, "
                    f"{stats.describe(ratio)}, extra {stats.describe(extra, unit=' us', digits=1)}"
                )
            lines.append(f"  rank {row['rank']}: " + "; ".join(parts))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--pairs", type=int, default=30, help="paired batches per size (default 30)")
    parser.add_argument("--calls", type=int, default=20, help="all-reduces per batch (default 20)")
    parser.add_argument("--output-dir", type=Path, default=Path("out/persistent_collectives_overhead"))
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
